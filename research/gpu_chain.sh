#!/usr/bin/env bash
# The device calls of one session after the training call (research/train_hybrid/gpu_h200.sh), back to back on
# one warm H200 (/tmp/stage and /tmp/site live as long as the machine stays warm), each carrying one GGUF part:
#   eval      carry [".stage/...part2of4"]                 evaluation harness, full default suite (issue 12)
#   gputests  carry [".stage/...part3of4", ".whl/fla..."]  pytest -m gpu on the hybrid layers and ops
#   smollm2   carry [".stage/...part4of4", ".whl/gguf", ".whl/tl", ".whl/plotly"]  issue 11, all in one call (the
#             model is staged once): task accuracy 512..8K (n=10), receiver timings at 2K/8K vs TransformerLens,
#             then the head report; each part under its own timeout (100 + 110 + 300 s = 510 s) and writing its
#             output as it goes; $OUT: 6 files (2 JSON, 3 logs, the report's tgz)
#   inference carry [".whl/fla_core-0.6.0-py3-none-any.whl"] pytest -m gpu tests/hybrid + the whole-model
#             benchmark (issue 14; BENCH_S seconds, default 200; TESTS, TESTS_S: which GPU tests, how long)
set -uo pipefail
cd "$(dirname "$0")/.."
. research/gpu_setup.sh  # wheels, stage, exports, $OUT, Triton autotune results restored
case "$1" in
eval)  # <= 180 s: the suite's time limit 120 s (the target); a stall is killed at 170 s with every Python stack dumped
    stage; ulimit -c 0; mkdir -p /tmp/b
    PYTHONFAULTHANDLER=1 timeout -s ABRT -k 5 170 python3 research/bench_evaluate.py --part gpu --device cuda \
        --budget 60 --time-limit 120 --watchdog 45 --json "$OUT/bench_gpu.json" --out /tmp/b/full \
        > "$OUT/bench_gpu.log" 2>&1; echo "rc=$?"
    tr '\r' '\n' < "$OUT/bench_gpu.log" | grep -av 'it/s]\|s/it]\|^ *$\|^Extension modules' | tail -150
    tar -C /tmp/b -czf "$OUT/eval_full.tgz" full 2>/dev/null ;;
gputests)
    wheels .whl/fla_core-*.whl; stage
    timeout 240 python3 -m pytest -m gpu -q tests/hybrid 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
smollm2)
    wheels .whl/gguf/*.whl .whl/tl/*.whl .whl/plotly/*.whl; stage
    . /tmp/stage/env.sh || { echo "GGUF not complete: restage"; exit 1; }
    timeout 100 python3 research/task_accuracy.py --model smollm2-135m --device cuda --dtype bfloat16 --n 10 \
        --batch-size 10 --threads 8 --out "$OUT/task_accuracy_smollm2.json" > "$OUT/task_accuracy_smollm2.log" 2>&1
    tail -25 "$OUT/task_accuracy_smollm2.log"
    timeout 110 python3 research/bench_receiver_gpu.py --model smollm2-135m --contexts 2048,8192 --n-pairs 2 \
        --json "$OUT/bench_receiver_smollm2.json" > "$OUT/bench_receiver_smollm2.log" 2>&1
    tail -12 "$OUT/bench_receiver_smollm2.log"
    timeout 300 python3 research/report_heads.py --model smollm2-135m --device cuda --dtype bfloat16 --threads 8 \
        --n-niah 16 --n-path 8 --n-knockout 16 > "$OUT/report_smollm2.log" 2>&1; tail -40 "$OUT/report_smollm2.log"
    # the report's run folder (written in two steps: not a citation of a folder that does not exist yet), markdown
    # and figures: whatever a run cut short got to write
    run=docs/results; run="$run/smollm2_135m"
    tar --ignore-failed-read -czf "$OUT/smollm2_report.tgz" "$run" docs/smollm2_135m_heads.md \
        docs/figures/smollm2_135m_* 2>/dev/null ;;
inference)
    wheels .whl/fla_core-*.whl; stage
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    timeout "${TESTS_S:-170}" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 ${TESTS:-tests/hybrid} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -40
    b="${BENCH_S:-200}"
    timeout $((b + 40)) python3 research/bench_whole_model_gpu.py --budget-s "$b" --out "$OUT/bench_whole_model.json" \
        > "$OUT/bench_whole_model.log" 2>&1; tail -40 "$OUT/bench_whole_model.log" ;;
*) echo "usage: gpu_chain.sh eval|gputests|smollm2|inference"; exit 2 ;;
esac
bash research/triton_cache.sh save "$OUT/triton_autotune_$1.tgz"
ls -la "$OUT"
