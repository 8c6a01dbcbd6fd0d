#!/usr/bin/env bash
# The decode levers' jobs on one GPU machine, one part per argument, each under its own time limit, results in $OUT
# (one file a part: the launcher's results folders would bring back more files than a command may). Each part runs
# its job's own program with the job's args from research/jobs.toml:
#   tests      gpu_tests_pdl        PDL's GPU tests                                 -> $OUT/gpu_tests_pdl.log
#   best       bench_decode_best    each model's fastest step at 32K batch 1          -> $OUT/bench_best_runN.json
#   pdl        bench_decode_pdl     the same with --pdl                               -> $OUT/bench_pdl_runN.json
#   combo      bench_decode_combo   the same with --inductor combo_kernels=true       -> $OUT/bench_combo_runN.json
#   best_128k  bench_decode_best_128k  best at 128K batch 1                          -> $OUT/bench_best_128k_runN.json
#   pdl_128k   bench_decode_pdl_128k   pdl at 128K batch 1                           -> $OUT/bench_pdl_128k_runN.json
#   tests_gemv gpu_tests_gemv       the decode GEMV's GPU tests                       -> $OUT/gpu_tests_gemv.log
#   gemv       bench_decode_gemv    best with --gemv (every model's projections)     -> $OUT/bench_gemv_runN.json
#   gemv_128k  bench_decode_gemv_128k  gemv at 128K batch 1                          -> $OUT/bench_gemv_128k_runN.json
#   split_gemv decode_time_split_gemv  split with --gemv                             -> $OUT/time_split_gemv.json
#   gemv_sweep gemv_sweep           the GEMV's tunings against cuBLAS                -> $OUT/gemv_sweep.json
#   attn_sweep decode_attention_sweep  the split-KV attention's tunings             -> $OUT/decode_attention_sweep.json
#   gdn_sweep  gdn_step_sweep       the fused GDN step's tunings                      -> $OUT/gdn_step_sweep.json
#   code_b8    (count_decode_ops, no job) inductor's code of the compiled steps at batch 8, one layer of the bench
#              widths (why the fused GDN op's inputs are copied there, not at batch 1) -> $OUT/code_b8.log
#   split      decode_time_split    where the step's time goes, one layer at the bench widths -> $OUT/time_split.json
#   split_pdl  decode_time_split_pdl  the same with --pdl                             -> $OUT/time_split_pdl.json
# e.g. `bash research/decode_levers.sh tests best pdl` after `python3 -m research.stage setup` and
# `. /tmp/stage/env.sh` (the fla wheel carried). RUN (default 1) numbers repeated bench runs.
set -u
OUT=${OUT:-.} RUN=${RUN:-1}
job_args() {  # the job's args, one per line
    python3 -c 'import sys; from research.launch import get_job
print("\n".join(map(str, get_job(sys.argv[1]).args)))' "$1"
}
for part in "$@"; do
    case $part in
        tests) job=gpu_tests_pdl ;; best) job=bench_decode_best ;; pdl) job=bench_decode_pdl ;;
        combo) job=bench_decode_combo ;; split) job=decode_time_split ;; split_pdl) job=decode_time_split_pdl ;;
        best_128k) job=bench_decode_best_128k ;; pdl_128k) job=bench_decode_pdl_128k ;;
        tests_gemv) job=gpu_tests_gemv ;; gemv) job=bench_decode_gemv ;; gemv_128k) job=bench_decode_gemv_128k ;;
        split_gemv) job=decode_time_split_gemv ;; gemv_sweep) job=gemv_sweep ;;
        attn_sweep) job=decode_attention_sweep ;; gdn_sweep) job=gdn_step_sweep ;; code_b8) job=decode_time_split ;;
        *) echo "decode_levers.sh: unknown part '$part' (tests best pdl combo best_128k pdl_128k split split_pdl" \
                "tests_gemv gemv gemv_128k split_gemv gemv_sweep attn_sweep gdn_sweep code_b8)" >&2
           exit 2 ;;
    esac
    mapfile -t args < <(job_args "$job")
    t0=$(date +%s)
    echo "== $part: job $job (run $RUN)"
    case $part in
        tests|tests_gemv) timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider "${args[@]}" 2>&1 | tail -15 \
                   | tee "$OUT/$job.log.tmp"
               mv "$OUT/$job.log.tmp" "$OUT/$job.log" ;;  # whole or not at all
        best|pdl|combo|best_128k|pdl_128k|gemv|gemv_128k)
            timeout 450 python3 -m research.bench_whole_model_gpu "${args[@]}" --out "$OUT/bench_${part}_run$RUN.json" \
                2>&1 | tail -6 ;;
        gemv_sweep) timeout 420 python3 -m research.perf.gemv_sweep "${args[@]}" --out "$OUT/gemv_sweep.json" \
                        2>&1 | tail -14 ;;
        attn_sweep) timeout 420 python3 -m research.perf.decode_attention_sweep "${args[@]}" \
                        --out "$OUT/decode_attention_sweep.json" 2>&1 | tail -6 ;;
        gdn_sweep) timeout 240 python3 -m research.perf.gdn_step_sweep "${args[@]}" --out "$OUT/gdn_step_sweep.json" \
                       2>&1 | tail -4 ;;
        code_b8)
            TORCH_LOGS=output_code timeout 300 python3 -m research.count_decode_ops --device cuda --compile \
                --fused-gdn --shape bench --batch 8 --layers 1 > "$OUT/code_b8.log.tmp" 2>&1
            mv "$OUT/code_b8.log.tmp" "$OUT/code_b8.log"  # whole or not at all
            grep -c "def call" "$OUT/code_b8.log" ;;
        split|split_pdl|split_gemv)
            timeout 300 python3 -m research.count_decode_ops "${args[@]}" --json "$OUT/time_$part.json" 2>&1 \
                | grep -E "^==|time:" | tail -30 ;;
    esac
    echo "== $part: $(( $(date +%s) - t0 )) s"
done
