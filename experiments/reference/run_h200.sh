#!/usr/bin/env bash
# Train + evaluate the default reference model on one H200 in one command (< 10 minutes).
#   device run: command "bash experiments/reference/run_h200.sh", carry ["data/corpus"], timeout_s 600
# Two trainings share the GPU: the reference model (7 min) and a text-only twin (2.5 min, perplexity
# reference; its model stays on the machine). Files in $OUT (<= 7, each < 16 MiB):
#   run.log               stdout/stderr of everything (both trainings, eval)
#   train_log.jsonl       the reference run's loss/accuracy curve
#   textonly_log.jsonl    the text-only run's loss curve
#   eval.json             eval_reference.py results (incl. the text-only model's perplexity)
#   default.tar.part-aa, -ab   the trained model folder; unpack with
#       cat default.tar.part-* | tar -x -C headscope/weights/default
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
MAIN_MIN="${MAIN_MIN:-7}"; TEXT_MIN="${TEXT_MIN:-2.5}"
log="$OUT/run.log"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$log" 2>&1
python3 -c "import torch, transformers, tokenizers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >>"$log" 2>&1

python3 experiments/reference/train_reference.py --out /tmp/textonly --text-only --max-minutes "$TEXT_MIN" \
    --workers 1 2>&1 | sed -u 's/^/[textonly] /' >>"$log" &
text_pid=$!
python3 experiments/reference/train_reference.py --out /tmp/ref --max-minutes "$MAIN_MIN" --workers 13 \
    2>&1 | sed -u 's/^/[ref] /' >>"$log"
wait "$text_pid"

cp /tmp/ref/log.jsonl "$OUT/train_log.jsonl" 2>/dev/null
cp /tmp/textonly/log.jsonl "$OUT/textonly_log.jsonl" 2>/dev/null
# the model comes back before evaluation, so a slow eval cannot lose it
(cd /tmp/ref && tar -cf - config.json generation_config.json model*.safetensors* tokenizer.json \
    tokenizer_config.json train_summary.json log.jsonl 2>>"$log") | split -b 15M - "$OUT/default.tar.part-"
ls -la /tmp/ref "$OUT" >>"$log" 2>&1

python3 experiments/reference/eval_reference.py --model /tmp/ref --text-only-model /tmp/textonly \
    --json "$OUT/eval.json" 2>&1 | sed -u 's/^/[eval] /' >>"$log"
tail -n 40 "$log"
