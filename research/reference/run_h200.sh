#!/usr/bin/env bash
# Train + evaluate the default reference model on one H200 in one command (< 10 minutes).
#   device run: command "STAGE=1 bash research/reference/run_h200.sh", carry ["data/corpus"], timeout_s 600
# The shipped model is three such calls (STAGE=1, 2, 3 below), then stage 4 by sweep_h200.sh.
# In stage 1 two trainings share the GPU: the reference model and a text-only twin (perplexity reference;
# its model stays on the machine). MAIN_MIN, TEXT_MIN (0 skips the twin) and REF_ARGS (extra
# train_reference.py flags) override a stage's preset.
# Files in $OUT (<= 7, each < 16 MiB):
#   run.log               stdout/stderr of everything (both trainings, eval)
#   train_log.jsonl       the reference run's loss/accuracy curve
#   textonly_log.jsonl    the text-only run's loss curve
#   eval.json             eval_reference.py results (incl. the text-only model's perplexity)
#   default.tar.part-aa, -ab   the trained model folder; unpack with
#       cat default.tar.part-* | tar -x -C headscope/weights/default
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
log="$OUT/run.log"
# STAGE picks the recipe of the shipped model (docs/reference_model.md); each later stage continues from the
# model in headscope/weights/default (unpack the previous stage's parts there first):
#   STAGE=1  from scratch, 7 min, plus the text-only twin (the perplexity reference)
#   STAGE=2  8 min: head dropout, multi-key prompts packed, answers-only NIAH loss, binding/two-hop x2
#   STAGE=3  8 min: as 2 plus extra queries per multi-key / binding prompt, binding x3
STAGE="${STAGE:-1}"
STAGE23="--init-from headscope/weights/default --head-drop 0.03 --haystack-weight 0.1 --multikey-min-len 128 \
--w-text 0.1 --w-multikey 0.35 --w-copy 0.05 --lr 1e-3 --warmup 0.05 --ramp 0"
case "$STAGE" in
  1) : "${MAIN_MIN:=7}" "${TEXT_MIN:=3}" "${REF_ARGS:=}" ;;
  2) : "${MAIN_MIN:=8}" "${TEXT_MIN:=0}" "${REF_ARGS:=$STAGE23 --w-niah 0.2 --w-reasoning 0.3 \
--reasoning-families arithmetic,comparison,binding,binding,two_hop,two_hop}" ;;
  3) : "${MAIN_MIN:=8}" "${TEXT_MIN:=0}" "${REF_ARGS:=$STAGE23 --w-niah 0.15 --w-reasoning 0.35 --extra-queries 3 \
--reasoning-families arithmetic,comparison,binding,binding,binding,two_hop,two_hop --seed 1}" ;;
  *) echo "STAGE=$STAGE: give 1, 2 or 3" >&2; exit 2 ;;
esac
echo "stage $STAGE: MAIN_MIN=$MAIN_MIN TEXT_MIN=$TEXT_MIN REF_ARGS=$REF_ARGS" >>"$OUT/run.log"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$log" 2>&1
python3 -c "import torch, transformers, tokenizers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >>"$log" 2>&1

text_pid=""
if [ "$TEXT_MIN" != "0" ]; then
  python3 research/reference/train_reference.py --out /tmp/textonly --text-only --max-minutes "$TEXT_MIN" \
      --workers 1 2>&1 | sed -u 's/^/[textonly] /' >>"$log" &
  text_pid=$!
fi
# shellcheck disable=SC2086
python3 research/reference/train_reference.py --out /tmp/ref --max-minutes "$MAIN_MIN" --workers 13 \
    ${REF_ARGS:-} 2>&1 | sed -u 's/^/[ref] /' >>"$log"
[ -n "$text_pid" ] && wait "$text_pid"

cp /tmp/ref/log.jsonl "$OUT/train_log.jsonl" 2>/dev/null
cp /tmp/textonly/log.jsonl "$OUT/textonly_log.jsonl" 2>/dev/null
# the model comes back before evaluation, so a slow eval cannot lose it
(cd /tmp/ref && tar -cf - config.json generation_config.json model*.safetensors* tokenizer.json \
    tokenizer_config.json train_summary.json log.jsonl 2>>"$log") | split -b 15M - "$OUT/default.tar.part-"
ls -la /tmp/ref "$OUT" >>"$log" 2>&1

text_args=""
[ -d /tmp/textonly ] && [ -n "$text_pid" ] && text_args="--text-only-model /tmp/textonly"
# shellcheck disable=SC2086
python3 research/reference/eval_reference.py --model /tmp/ref $text_args \
    --json "$OUT/eval.json" 2>&1 | sed -u 's/^/[eval] /' >>"$log"
tail -n 40 "$log"
