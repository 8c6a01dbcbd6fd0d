#!/usr/bin/env bash
# Issue 16 on 2 GPUs of one host (device kind nvidia-h200-x2), one call (~8 min):
#   carry: .whl/fla_core-0.6.0-py3-none-any.whl, data/gz
#   run:   bash research/gpu_x2.sh            -> $OUT/bench_sharded_scoring.json, $OUT/bench_distributed_train.json
# 1) sharded head scoring: the Qwen3-1.7B-shaped random model, bf16, 2 pairs of 4096 tokens, 1 GPU against 2
#    (shard by heads and by samples): the same scores, the speed-up (target >= 1.8x);
# 2) stage 2 of the transfer training on the reference teacher, 60 steps of 16 x 2048 tokens: 1 GPU against
#    2 with DDP and with FSDP: loss curves, tokens/s (target DDP >= 1.8x), peak memory per GPU (FSDP < DDP).
# Each part prints its table; both JSONs land in $OUT. The CPU versions (gloo) of both commands are in
# docs/receiver_scores.md ("Sharded scoring") and docs/training.md ("Distributed").
set -uo pipefail
cd "$(dirname "$0")/.."
. research/gpu_setup.sh
wheels .whl/fla_core-*.whl
corpus
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PART="${PART:-scoring,train}"
if [[ ",$PART," == *",scoring,"* ]]; then
    timeout 300 python research/bench_sharded_scoring.py --world 1,2 --out "$OUT" 2>&1 | stamp | tee "$OUT/sharded.log"
fi
if [[ ",$PART," == *",train,"* ]]; then
    timeout 420 python research/bench_distributed_train.py --out "$OUT/dist" 2>&1 | stamp | tee "$OUT/dist.log"
fi
bash research/triton_cache.sh save
