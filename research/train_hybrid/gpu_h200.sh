#!/usr/bin/env bash
# H200 calls of research/train_hybrid/run.py: teacher -> 1/8-KV head-level hybrid, three stages, evaluation.
#   bash research/train_hybrid/gpu_h200.sh [train|throughput|stage]      CONFIG=... (default reference.toml)
# train       (default) train + evaluate (run.py), bring back results.json, train.log and the run (weights only when
#             they fit $OUT's limits: the reference's do, SmolLM2's ~0.5 GB do not)
# throughput  run.py --throughput-only: the untrained hybrid's stage-2 step and the teacher's own training step over a
#             sweep of batch sizes at the stage-1/2 length (tokens/s, TFLOP/s, MFU vs 790); $OUT/throughput.json. It
#             also makes the mask (kept in $RUN for the training calls) and fla's first-call autotuning at this head
#             dim (kept in ~/.triton while the machine stays warm, and saved to $OUT for research/gpu_cache/);
#             RUN_ARGS="--compare-naive" also times the full-logits stage-2 loss beside the fused one; RUN_ARGS="--profile" adds
#             each step's kernel time by category and its top kernels (research.perf.throughput.profile_step),
#             "--compile" times the step with the student's decoder layers torch.compile'd beside the eager one, and
#             with the frozen teacher's layers compiled and in bf16 as well (the first compile of each batch shape
#             happens in the warm-up steps; measured on SmolLM2: batch 32 with --compile --profile, four timings
#             and two compiles, 237 s after the mask; batch 64 with "--compile --compiled-only --profile" on a warm
#             machine, 166 s after the mask, 203 s in all; a fresh process at 64 was killed by TP_TIMEOUT=255: give
#             compile calls TP_TIMEOUT >= 400); "--compiled-only" skips the eager step and teacher step (for a batch
#             whose eager step does not fit: SmolLM2 at 64); "--compile-mode" picks torch.compile's mode
#             (reduce-overhead, CUDA graphs, is refused on CUDA, where it failed: docs/training.md); every timing is
#             printed and written to throughput.json as soon as it is taken
# stage       put the carried GGUF parts into /tmp/stage and stop (a call that only carries a part)
# Env: CONFIG; RESUME=1 continues the run in $RUN (/tmp/th-<config name>) after a call that stopped at a checkpoint
# (exit 3: "continue with --resume") or was killed; BUDGET_SCALE multiplies the stages' max_minutes (default 0.6 for
# reference.toml, 1 otherwise); STOP_AFTER (s, default 420; 0 = never) stops the training at the first checkpoint
# past it; TRAIN_TIMEOUT (s, default 530 reference / 500 otherwise) kills run.py; PARITY=1 (default for
# reference.toml only) re-checks fla's Hopper backward at head dim 32 (D = 32 and 64 are verified:
# hybrid/ops/gdn.py); N_EVAL prompts per NIAH length (default 30); BATCHES for throughput (default 8,16,32,48,64);
# PARITY_CHECK=0 skips the backend parity of the trained hybrid (after a finished run, <= PARITY_TIMEOUT=120 s);
# TRACE=SECONDS dumps every thread's stack that often (research/trace_run.py); RUN_ARGS: more run.py arguments (a
# CPU dry run of the script: CONFIG=research/train_hybrid/smollm2_tiny.toml RUN_ARGS="--tiny --n 1", python3 on PATH
# the project's venv).
#
# Reference teacher: one call, carry [".whl/fla_core-0.6.0-py3-none-any.whl", ".whl/plotly", "data/gz"], timeout_s 600,
# command "bash research/train_hybrid/gpu_h200.sh".
#
# SmolLM2-135M (CONFIG=research/train_hybrid/smollm2.toml): its GGUF (93 MB) travels in 4 parts
# (bash research/stage_gguf.sh split -> .stage/smollm2-135m.gguf.part{1..4}of4: 27.26, 27.26, 27.26, 16.57 MB), one
# per call, on ONE warm machine (/tmp/stage, /tmp/site and ~/.triton live while it stays warm: 30 s between calls, so
# make the calls back to back). Carry limit 64 MiB = 67.1 MB with the tree (git ls-files: 33.6 MB on 2026-12-01;
# measure: git ls-files -z | xargs -0 du -cb | tail -1). Device seconds are estimates:
#   1. carry [".stage/smollm2-135m.gguf.part1of4"]  33.6 + 27.3 = 60.9 MB; ~70-100 s (machine start) + 5 s
#      command "bash research/train_hybrid/gpu_h200.sh stage"
#   2. the same with part2of4                         60.9 MB; ~15 s with the transfer
#   3. the same with part3of4                         60.9 MB; ~15 s
#      (any call that carries a part and runs `stage` will do: gpu_chain.sh eval/gputests/smollm2 each carry one)
#   4. carry [".stage/smollm2-135m.gguf.part4of4", ".whl/gguf", ".whl/fla_core-0.6.0-py3-none-any.whl"]
#      33.6 + 16.6 + 0.1 + 1.1 = 51.4 MB; timeout_s 460 (run.py gets TP_TIMEOUT=400 s); ~200-300 s: GGUF joined (sha256) and converted once
#      (~10 s), mask (~20 s), fla autotune at D = 64 (<= ~170 s on a bare GPU), the batch sweep (~10 s a batch)
#      command "CONFIG=research/train_hybrid/smollm2.toml bash research/train_hybrid/gpu_h200.sh throughput"
#   5. carry [".whl/gguf", ".whl/fla_core-0.6.0-py3-none-any.whl", ".whl/plotly", "data/gz"]
#      33.6 + 0.1 + 1.1 + 10.2 + 2.6 = 47.6 MB; timeout_s 560; ~510 s: stage 1 (1.5 min) and most of stage 2, stopped at
#      the first checkpoint past 420 s (exit 3)
#      command "CONFIG=research/train_hybrid/smollm2.toml bash research/train_hybrid/gpu_h200.sh train"
#   6. the same carry, timeout_s 560, ~350-400 s: the rest of stage 2, stage 3 (2 min), the evaluation (~1-1.5 min)
#      command "RESUME=1 CONFIG=research/train_hybrid/smollm2.toml bash research/train_hybrid/gpu_h200.sh train"
#      (again with RESUME=1 if it stopped at a checkpoint once more; a finished run is evaluated straight away)
#   Measured 2026-12-01: `stage` calls 2 s each once warm, throughput 158 s (the
#   autotune results restored), call 5 454 s (stopped at distill step 600), call 6 341 s (the rest; stages 9.5 min in
#   all), an evaluation-only resume 204 s. Part 4 (16.6 MB) also fits beside the reference call's carry (64.3 MB),
#   which saves one call; the throughput call (4) may be skipped once measured: carry part 4 with a `stage` call.
#   Measured again 2026-12-01 (docs/results/2026-12-01_smollm2_hybrid_training): reference call with part 4 389 s (training 4.42
#   min, evaluation, backend parity), `stage` 2 s each, throughput with --compare-naive at 16,32,64 113 s, call 5
#   468 s (stopped at distill step 600), call 6 512 s (the rest, evaluation 165 s, backend parity).
#   Measured 2026-12-02 (docs/results/2026-12-02_reference_hybrid_training): reference call with part 4 369 s (stages 4.52 min,
#   evaluation 66 s, no backend parity), `stage` 1-3 s each once warm, throughput at batch 32 with "--compile
#   --profile" 300 s; a fresh machine's first call costs ~90 s of device time before the command starts.
#   In all ~1200-1350 device seconds (20-23 min) of a session's 30. If the machine went cold in between, everything
#   staged is gone: calls 1-4 again (call 4's throughput may be skipped by running `stage` with part 4 instead).
set -uo pipefail
cd "$(dirname "$0")/../.."
. research/gpu_setup.sh  # exports, $OUT, Triton autotune results restored
MODE="${1:-train}"
CONFIG="${CONFIG:-research/train_hybrid/reference.toml}"
name="$(basename "$CONFIG" .toml)"
RUN="/tmp/th-$name"
ref=0; [ "$name" = reference ] && ref=1
case "$MODE" in train|throughput|stage) ;; *) echo "usage: gpu_h200.sh [train|throughput|stage] (CONFIG=...)"; exit 2 ;; esac
[ -f "$CONFIG" ] || { echo "CONFIG=$CONFIG: no such file"; exit 2; }

optional_wheels .whl/gguf .whl/plotly; stage  # the GGUF parts carried with this call (if any) into /tmp/stage
if [ "$MODE" = stage ]; then ls -la /tmp/stage; exit 0; fi
staged_teacher "$(toml_get "$CONFIG" teacher default)" || exit 1
wheels .whl/fla_core-*.whl; [ "$MODE" = train ] && corpus
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${TRACE:-}" ]; then py="python3 research/trace_run.py --every $TRACE"; else py=python3; fi

if [ "$MODE" = throughput ]; then
    mkdir -p "$RUN"
    timeout "${TP_TIMEOUT:-400}" $py research/train_hybrid/run.py --config "$CONFIG" --out "$RUN" --throughput-only \
        --batches "${BATCHES:-8,16,32,48,64}" ${RUN_ARGS:-} 2>&1 | stamp | tee "$OUT/throughput.log" | grep -v "it/s\]$\|head/s"
    rc=${PIPESTATUS[0]}; echo "run.py --throughput-only: rc=$rc"
    cp "$RUN/throughput.json" "$RUN/mask.json" "$OUT/" 2>/dev/null
    bash research/triton_cache.sh save "$OUT/triton_autotune_${name}_throughput.tgz"
    ls -la "$OUT"; exit $rc
fi

# 1. fla's unguarded backward at D = 32 against the float32 PyTorch reference (the reference model's head dim)
if [ "${PARITY:-$ref}" = 1 ]; then OUT=$OUT/parity timeout 170 python3 research/fla_parity_gpu.py --dims 32 --lengths 1024 --gate-normalizers 1.0 \
    2>&1 | tee "$OUT/parity32.log" | grep -E "RECOMMENDATION|all dispatch|guard"
if grep -q "(32, 32)" "$OUT/parity32.log"; then
    export HYBRID_ALLOW_UNVERIFIED_HOPPER_BWD=1; echo "D=32 verified: fla backward used"
else
    echo "D=32 not verified: torch-chunk backward"
fi; fi
# 2. train + evaluate (budgets scaled)
if [ "$ref" = 1 ]; then scale="${BUDGET_SCALE:-0.6}"; limit="${TRAIN_TIMEOUT:-530}"; else scale="${BUDGET_SCALE:-1}"; limit="${TRAIN_TIMEOUT:-500}"; fi
python3 - "$scale" "$CONFIG" "/tmp/${name}_gpu.toml" <<'PY'
import re, sys
s = float(sys.argv[1]); t = open(sys.argv[2]).read()
t = re.sub(r"max_minutes = ([0-9.]+)", lambda m: f"max_minutes = {float(m.group(1)) * s:.3f}", t)
open(sys.argv[3], "w").write(t)
PY
# RESUME=1 continues the run in $RUN (a warm machine after a stopped or killed call); otherwise start afresh, keeping
# a mask (and its scores) that a throughput call of the same config made
if [ "${RESUME:-0}" = 1 ]; then resume=--resume; else resume=; rm -rf "$RUN/run" "$RUN/results.json"; fi
stop="${STOP_AFTER:-420}"; [ "$stop" = 0 ] && stop= || stop="--stop-after $stop"
timeout "$limit" $py research/train_hybrid/run.py --config "/tmp/${name}_gpu.toml" --out "$RUN" --n "${N_EVAL:-30}" \
    $resume $stop ${RUN_ARGS:-} 2>&1 | stamp | tee "$OUT/train.log" | grep -v "it/s\]$\|step/s\|head/s" | tail -80
rc=${PIPESTATUS[0]}
case $rc in
0) echo "run.py finished" ;;
3) echo "run.py stopped at a checkpoint: call again with RESUME=1" ;;
124) echo "run.py killed at ${limit} s: call again with RESUME=1 (the newest checkpoint is kept)" ;;
*) echo "run.py failed (rc=$rc)" ;;
esac
cp "$RUN/results.json" "$RUN/eval_rows.csv" "$OUT/" 2>/dev/null
# the trained hybrid under each precision and kernel backend (research/train_hybrid/backend_parity.py): the
# eighth session's hybrid scored 4.22 in the trainer's bf16 check and 4.55 reloaded in float32 on the same windows
if [ "$rc" = 0 ] && [ -f "$RUN/run/hybrid/config.json" ] && [ "${PARITY_CHECK:-1}" = 1 ]; then
    timeout "${PARITY_TIMEOUT:-120}" python3 research/train_hybrid/backend_parity.py --model "$RUN/run/hybrid" \
        --out "$OUT/backend_parity.json" 2>&1 | grep -v "^Loading" | tail -12
fi
# the run comes back in parts of 15 MB ($OUT: 8 files of <= 16 MiB): mask, scores, log, figure, and the trained
# weights where they fit (the reference's ~28 MB; not SmolLM2's); here: cat run.tgz.part* | tar -xz -C runs/gpu_hybrid,
# then python research/train_hybrid/run.py --config CONFIG --out runs/gpu_hybrid --eval-only
weights=; [ "$ref" = 1 ] && weights=run/hybrid
tar -C "$RUN" --ignore-failed-read -czf /tmp/run.tgz mask.json scores.json $weights run/log.jsonl run/training.html \
    2>/dev/null && split -b 15M -d /tmp/run.tgz "$OUT/run.tgz.part"
bash research/triton_cache.sh save "$OUT/triton_autotune_${name}_train.tgz"
ls -la "$OUT"
exit $rc
