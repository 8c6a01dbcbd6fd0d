#!/usr/bin/env bash
# One H200 call: issue 15's studies 2-5 on the reference teacher, every variant trained and evaluated side by side
# (experiments/studies/run_studies.py, one process per variant), stopped by its own deadline before the call's
# limit, results to $OUT (6 files, flat: studies.log, studies.json, tables.md, studies.html, studies_run.tgz,
# triton_autotune_studies.tgz). The main process tunes fla's kernels once before the hybrids' workers start
# (run_study's warm-up; with the autotune results of experiments/gpu_cache restored it only compiles).
#   device call: carry [".whl/fla_core-0.6.0-py3-none-any.whl", ".whl/plotly", "data/gz"], timeout_s 600,
#   command "STEPS_SCALE=1 bash experiments/studies/gpu_h200.sh"
# Resume: the same command again on the warm machine continues (the study folder runs/studies is an ignored path
# of the repository, kept between calls): finished variants are skipped, training resumes from checkpoints,
# evaluation from the next item. Keep STEPS_SCALE the same (a changed budget over existing checkpoints is refused;
# RESTART_CHANGED=1 trains those variants again from the start with the new budget).
# On a fresh machine, RESTORE=<a studies_run.tgz of an earlier call, carried> restores the finished variants first.
# Env: STEPS_SCALE (every stage's steps, all variants alike; default 1), JOB_S (seconds this script may use,
# default 520), ONLY / STUDIES (subsets, comma-separated), RUN (the study folder).
set -uo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
RUN="${RUN:-runs/studies}"
. experiments/gpu_setup.sh  # exports, $OUT, Triton autotune results restored
corpus; [ -d /tmp/site/fla ] || wheels .whl/fla_core-0.6.0-py3-none-any.whl; [ -d /tmp/site/plotly ] || optional_wheels .whl/plotly; stage  # GGUF parts travel too
# fla's Hopper backward at head dim 32: verified against the float32 reference on the H200 on 2026-12-01
# (docs/results/session5_h200/fla_parity_d32.log) and listed in hybrid.ops.gdn.HOPPER_BWD_VERIFIED_DIMS; the
# variable only keeps an older checkout from falling back to the slow torch-chunk backward
export HYBRID_ALLOW_UNVERIFIED_HOPPER_BWD=1
if [ -n "${RESTORE:-}" ] && [ ! -d "$RUN" ]; then mkdir -p "$RUN" && tar -xzf "$RESTORE" -C "$RUN"; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
JOB_S="${JOB_S:-520}"
deadline=$(( JOB_S - ($(date +%s) - t0) - 45 ))  # 45 s left for stopping the workers, the tables and the tar
echo "setup $(( $(date +%s) - t0 )) s; study deadline ${deadline} s; STEPS_SCALE=${STEPS_SCALE:-1}"
timeout $(( deadline + 30 )) python3 experiments/studies/run_studies.py --config experiments/studies/reference.toml \
    --out "$RUN" --deadline-s "$deadline" --steps-scale "${STEPS_SCALE:-1}" --status-every 30 \
    ${ONLY:+--only "$ONLY"} ${STUDIES:+--studies "$STUDIES"} ${RESTART_CHANGED:+--restart-changed} \
    > "$OUT/studies.log" 2>&1 &
pid=$!
tail -n +1 -f "$OUT/studies.log" --pid=$pid | grep --line-buffered -E "^\[studies\]|rror|Traceback" &
wait $pid; rc=$?
sleep 1
echo "run_studies exit $rc (0: all finished, 3: unfinished, rerun to continue; 124: hard timeout)"
python3 experiments/studies/render_studies.py --run "$RUN" --out "$OUT" --source "${SOURCE:-studies_run.tgz of this call}" \
    > "$OUT/tables.log" 2>&1 || tail -5 "$OUT/tables.log"
tar -czf "$OUT/studies_run.tgz" -C "$RUN" --exclude=checkpoints --exclude=hybrid --exclude='*.html' \
    --exclude='*.safetensors' --exclude='*.pt' . 2>/dev/null
rm -f "$OUT/tables.log"
bash experiments/triton_cache.sh save "$OUT/triton_autotune_studies.tgz"  # for experiments/gpu_cache
ls -la "$OUT"; echo "total $(( $(date +%s) - t0 )) s"
