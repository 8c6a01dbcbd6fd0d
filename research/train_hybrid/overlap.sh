#!/usr/bin/env bash
# Two jobs (train_hybrid, or studies of one trained row each) on one GPU inside one command's time limit (a
# machine lent 10 minutes a command): job A first; once A's hybrid is trained (its evaluation leaves most of the
# GPU idle: generation and short batches), job B trains beside A's evaluation. Both run with --resume, so the same
# command, called again, continues whatever was cut (a cut stage from its last checkpoint, a cut evaluation from
# its last finished part) until both say done. Their fidelity suites share the teacher's side (RUNS/teacher_cache).
#
#   research/train_hybrid/overlap.sh JOB_A JOB_B [SECONDS=555] [RUNS=/tmp/runs]
#   e.g. research/train_hybrid/overlap.sh smollm2_broad_hybrid smollm2_broad_hybrid_seed1
#
# Results in RUNS/JOB_A and RUNS/JOB_B; each call's launcher output in $OUT (else RUNS/logs) as JOB_HHMMSS.log.
# A stops training STOP_A seconds before the limit (default 30), checkpointing the step it is on (--stop-after), so
# the next call loses no step; a cut evaluation keeps its finished parts. B starts only with at least MIN_B seconds
# left (default 240: loading and compiling take ~90 s) and stops the same way 150 s before the limit.
# Exit status: 0 when both jobs are done, 3 when either should be called again.
set -u
if [ $# -lt 2 ]; then sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
A=$1 B=$2 LIMIT=${3:-555} RUNS=${4:-/tmp/runs} MIN_B=${MIN_B:-240} POLL=${POLL:-5} STOP_A=${STOP_A:-30}
case "$LIMIT" in ''|*[!0-9]*) echo "overlap.sh: SECONDS must be a whole number of seconds, not '$LIMIT'" >&2; exit 2 ;; esac
LOGS=${OUT:-$RUNS/logs}
# both jobs' fidelity suites keep the teacher's side (continuations, chat answers, NIAH) here and read it back
export HEADSCOPE_TEACHER_CACHE=${HEADSCOPE_TEACHER_CACHE:-$RUNS/teacher_cache}
mkdir -p "$LOGS" "$RUNS"
t0=$(date +%s)
left() { echo $((LIMIT - ($(date +%s) - t0))); }
stamp=$(date +%H%M%S)
trained() {  # a train_hybrid job's hybrid, or any trained row of a studies job (one row per job: its --only)
    [ -f "$RUNS/$A/run/hybrid/config.json" ] || compgen -G "$RUNS/$A/study/variants/*/seed*/run/hybrid/config.json" >/dev/null
}

echo "[overlap] $A: start ($(left) s left)"
timeout "$LIMIT" python3 -m research.launch "$A" --out "$RUNS/$A" --resume --stop-after "$((LIMIT - STOP_A))" \
    > "$LOGS/${A}_$stamp.log" 2>&1 &
pa=$!
while ! trained && kill -0 "$pa" 2>/dev/null && [ "$(left)" -ge "$MIN_B" ]; do sleep "$POLL"; done
rb=3
if trained && [ "$(left)" -ge "$MIN_B" ]; then
    l=$(left)
    echo "[overlap] $A trained; $B: start ($l s left)"
    timeout "$((l - 5))" python3 -m research.launch "$B" --out "$RUNS/$B" --resume --stop-after "$((l - 150))" \
        > "$LOGS/${B}_$stamp.log" 2>&1
    rb=$?
else
    echo "[overlap] $B: not started ($(left) s left; $A $(trained && echo trained || echo 'not trained yet'))"
fi
wait "$pa"
ra=$?
echo "[overlap] $A exit $ra, $B exit $rb after $(($(date +%s) - t0)) s"
for log in "$LOGS/${A}_$stamp.log" "$LOGS/${B}_$stamp.log"; do
    [ -f "$log" ] && { echo "--- $(basename "$log") (last launcher lines)"; grep -a '^\[launch\]\|^\[run.py\]' "$log" | tail -4; }
done
[ "$ra" = 0 ] && [ "$rb" = 0 ] && exit 0
exit 3
