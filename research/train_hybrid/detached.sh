#!/usr/bin/env bash
# One job across several commands of a GPU machine without stopping it between them: the first call starts
# `python3 -m research.launch JOB --resume` detached from the command by setsid, which the machine lets run on after the
# command returns; every call, the first included, then waits up to SECONDS for it, printing the launcher's lines as
# they come. Against a job stopped and resumed at each command's limit (overlap.sh) this saves, per command
# boundary, the stop margin (30 s) and the restart (loading and the first compiled step: 44-50 s of stage 2 on an
# H100 for the SmolLM2 recipes). The machine still goes back 30 s after a command ends: call again at once.
# The job runs from a copy of the checkout made when it starts (RUNS/.repo_JOB; .stage, .whl, .venv and .git left
# out), so the working tree that each command copies in again cannot change a file under the running job.
#
#   research/train_hybrid/detached.sh JOB [SECONDS=560] [RUNS=/tmp/runs]
#
# Results in RUNS/JOB; the launcher's output in RUNS/JOB.detached.log (copied to $OUT when set). Exit status: the
# job's own (0 when done) once it has ended, 3 while it still runs (call again), 2 for bad arguments.
set -u
if [ $# -lt 1 ]; then sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
JOB=$1 LIMIT=${2:-560} RUNS=${3:-/tmp/runs} POLL=${POLL:-5}
case "$LIMIT" in ''|*[!0-9]*) echo "detached.sh: SECONDS must be a whole number of seconds, not '$LIMIT'" >&2; exit 2 ;; esac
export HEADSCOPE_TEACHER_CACHE=${HEADSCOPE_TEACHER_CACHE:-$RUNS/teacher_cache}
mkdir -p "$RUNS"
LOG=$RUNS/$JOB.detached.log PID=$RUNS/$JOB.detached.pid RC=$RUNS/$JOB.detached.rc
t0=$(date +%s)
running() { [ -f "$PID" ] && kill -0 "$(cat "$PID")" 2>/dev/null; }
# the log's length before this call: a job started below and done at once still has its lines shown
seen=$( [ -f "$LOG" ] && wc -l < "$LOG" || echo 0)

if running; then
    echo "[detached] $JOB: running since an earlier command (pid $(cat "$PID")); waiting up to $LIMIT s"
elif [ -f "$RC" ] && [ "$(cat "$RC")" = 0 ]; then
    echo "[detached] $JOB: already done (RUNS/$JOB.detached.rc = 0)"
else
    rm -f "$RC"
    SNAP=$RUNS/.repo_$JOB
    rm -rf "$SNAP" && mkdir -p "$SNAP" \
        && tar -C . --exclude=./.stage --exclude=./.whl --exclude=./.venv --exclude=./.git -cf - . \
           | tar -C "$SNAP" -xf - \
        || { echo "detached.sh: could not copy the checkout to $SNAP" >&2; exit 1; }
    # detached (setsid): the machine ends a command's other processes when it returns
    # the status and the pid written under a temporary name, then renamed: a reader sees all of it or nothing
    setsid bash -c 'cd "$4" && python3 -m research.launch "$1" --out "$2" --resume
                    echo $? > "$3.tmp" && mv "$3.tmp" "$3"' _ \
        "$JOB" "$RUNS/$JOB" "$RC" "$SNAP" >> "$LOG" 2>&1 < /dev/null &
    echo $! > "$PID.tmp" && mv "$PID.tmp" "$PID"
    echo "[detached] $JOB: started (pid $(cat "$PID")); waiting up to $LIMIT s"
fi
show() {  # the launcher's and run.py's new lines since the last look
    [ -f "$LOG" ] || return 0
    local n; n=$(wc -l < "$LOG")
    [ "$n" -gt "$seen" ] && sed -n "$((seen + 1)),${n}p" "$LOG" | tr '\r' '\n' | grep -a '^\[launch\]\|^\[run.py\]\|^\[study\]'
    seen=$n
}
while running && [ $(($(date +%s) - t0)) -lt "$LIMIT" ]; do sleep "$POLL"; show; done
show
[ -n "${OUT:-}" ] && [ -f "$LOG" ] && mkdir -p "$OUT" && cp "$LOG" "$OUT/$JOB.detached.log"
if running; then
    echo "[detached] $JOB: still running after $(($(date +%s) - t0)) s: call again within 30 s"
    exit 3
fi
rc=$(cat "$RC" 2>/dev/null || echo 1)
echo "[detached] $JOB: ended with exit $rc"
exit "$rc"
