#!/usr/bin/env bash
# The decode levers on one GPU machine, one part per argument, each under its own time limit, results in $OUT:
#   tests      PDL's GPU tests (gpu_tests_pdl's selection)                       -> $OUT/gpu_tests_pdl.log
#   best       each model's fastest step at 32K batch 1 (bench_decode_best)      -> $OUT/bench_best_runN.json
#   pdl        the same with --pdl (bench_decode_pdl)                            -> $OUT/bench_pdl_runN.json
#   combo      the same with --inductor combo_kernels=true (bench_decode_combo)  -> $OUT/bench_combo_runN.json
#   split      where the step's time goes, one layer at the bench widths          -> $OUT/time_split.json
#   split_pdl  the same with --pdl                                                -> $OUT/time_split_pdl.json
# e.g. `bash research/decode_levers.sh tests best pdl` after `python3 -m research.stage setup` and
# `. /tmp/stage/env.sh` (the fla wheel carried). RUN (default 1) numbers repeated bench runs.
set -u
OUT=${OUT:-.} RUN=${RUN:-1}
BENCH=(--sections decode --contexts 32768 --batches 1 --compile-decode --fused-gdn --best-only --budget-s 300)
SPLIT=(--device cuda --compile --fused-gdn --shape bench --batch 1 --context 32768 --times 50)
for part in "$@"; do
    t0=$(date +%s)
    echo "== $part (run $RUN)"
    case $part in
        tests) timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/hybrid/ops/test_decode_attention.py \
                   tests/hybrid/ops/test_gdn_decode.py tests/hybrid/test_decoding.py -k "pdl or dependent" \
                   2>&1 | tail -15 | tee "$OUT/gpu_tests_pdl.log" ;;
        best) timeout 360 python3 -m research.bench_whole_model_gpu "${BENCH[@]}" --out "$OUT/bench_best_run$RUN.json" \
                  2>&1 | grep -v "^\s*$" | tail -6 ;;
        pdl) timeout 360 python3 -m research.bench_whole_model_gpu "${BENCH[@]}" --pdl \
                 --out "$OUT/bench_pdl_run$RUN.json" 2>&1 | tail -6 ;;
        combo) timeout 360 python3 -m research.bench_whole_model_gpu "${BENCH[@]}" --inductor combo_kernels=true \
                   --out "$OUT/bench_combo_run$RUN.json" 2>&1 | tail -6 ;;
        split) timeout 300 python3 -m research.count_decode_ops "${SPLIT[@]}" --json "$OUT/time_split.json" \
                   2>&1 | grep -E "^==|time:" | tail -30 ;;
        split_pdl) timeout 300 python3 -m research.count_decode_ops "${SPLIT[@]}" --pdl \
                       --json "$OUT/time_split_pdl.json" 2>&1 | grep -E "^==|time:" | tail -30 ;;
        *) echo "decode_levers.sh: unknown part '$part' (tests best pdl combo split split_pdl)" >&2; exit 2 ;;
    esac
    echo "== $part: $(( $(date +%s) - t0 )) s"
done
