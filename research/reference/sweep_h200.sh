#!/usr/bin/env bash
# Several continuations of the shipped model trained side by side on ONE H200, each evaluated; the best comes back.
#   device run: command "bash research/reference/sweep_h200.sh", carry ["data/corpus"], timeout_s 600
# Why: a 7 M model uses a small part of the GPU and each run is bound by its data workers, so four recipes cost
# about one call. SWEEP_MIN (training minutes, default 6.5) and WORKERS (data workers per run, default 3) override.
# The variants (name|flags) are below; every one starts from headscope/weights/default. SHIPPED_EVAL is the
# eval JSON of that starting model, the bar to beat (default: the shipped stage 4's; the stage-4 sweep itself
# started from stage 3: SHIPPED_EVAL=docs/results/2026-11-29_reference_pretrain_stage3/reference_eval3_h200.json).
# Files in $OUT (<= 5):
#   sweep.json              each variant's flags, eval summary and the checks it passes; "best" names the winner
#   sweep_logs.tar          run.log, each variant's train_log.jsonl and eval.json
#   best.tar.part-aa, -ab   the winner's model folder, only if it beats the shipped model's eval (the same
#                           score: checks passed, then multi-key + binding accuracy); unpack with
#                           cat best.tar.part-* | tar -x -C headscope/weights/default
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/sweep
log=/tmp/sweep/run.log
SWEEP_MIN="${SWEEP_MIN:-6.5}"; WORKERS="${WORKERS:-3}"
SHIPPED_EVAL="${SHIPPED_EVAL:-docs/results/2026-11-29_reference_pretrain_stage4_sweep/reference_eval4_h200.json}"
# lookup-focused continuation: multi-key and binding get 80% of the rows between them, NIAH keeps 10%
BASE="--init-from headscope/weights/default --head-drop 0.03 --haystack-weight 0.1 --multikey-min-len 128 \
--w-text 0.05 --w-niah 0.1 --w-multikey 0.4 --w-reasoning 0.4 --w-copy 0.05 --warmup 0.05 --ramp 0 --fast-niah \
--reasoning-families arithmetic,comparison,two_hop,binding,binding,binding,binding --seed 2"
DENSE="--extra-queries 8 --binding-vars 2-8 --max-keys 8"
VARIANTS=(
  "focus|$BASE --extra-queries 3 --lr 1e-3"
  "focus_hot|$BASE --extra-queries 3 --lr 3e-3"
  "dense|$BASE $DENSE --lr 1e-3"
  "dense_hot|$BASE $DENSE --lr 3e-3"
)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$log" 2>&1
pids=()
for v in "${VARIANTS[@]}"; do
  name="${v%%|*}"; flags="${v#*|}"
  echo "variant $name: $flags" >>"$log"
  # shellcheck disable=SC2086
  python3 research/reference/train_reference.py --out "/tmp/sweep/$name" --max-minutes "$SWEEP_MIN" \
      --workers "$WORKERS" $flags 2>&1 | sed -u "s/^/[$name] /" >>"$log" &
  pids+=($!)
done
wait "${pids[@]}"
for v in "${VARIANTS[@]}"; do
  name="${v%%|*}"
  python3 research/reference/eval_reference.py --model "/tmp/sweep/$name" --json "/tmp/sweep/$name/eval.json" \
      2>&1 | sed -u "s/^/[eval $name] /" >>"$log" &
done
wait
python3 - "$OUT" "$SHIPPED_EVAL" "${VARIANTS[@]}" <<'EOF' >>"$log" 2>&1
import json, sys
from pathlib import Path
out, shipped_eval, variants = Path(sys.argv[1]), Path(sys.argv[2]), [v.split("|", 1) for v in sys.argv[3:]]

def score(ev):  # checks passed, then multi-key + binding accuracy
    return (sum(ev["checks"].values()), ev["multikey"] + ev["reasoning"]["binding"])

shipped = json.loads(shipped_eval.read_text())  # the starting model's eval: the bar to beat
rows, best = {}, None
for name, flags in variants:
    path = Path(f"/tmp/sweep/{name}/eval.json")
    if not path.exists():
        rows[name] = dict(flags=flags, error="no eval.json (training or eval failed: see run.log)")
        continue
    ev = json.loads(path.read_text())
    rows[name] = dict(flags=flags, score=score(ev), **{k: ev[k] for k in ("niah_mean", "niah_min_depth", "multikey",
                                                                          "reasoning", "knockout", "checks", "ppl")})
    if score(ev) > score(shipped) and (best is None or score(ev) > rows[best]["score"]):
        best = name
summary = dict(shipped_score=score(shipped), best=best, variants=rows)
(out / "sweep.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
print("BEST", best)
EOF
best=$(python3 -c "import json; print(json.load(open('$OUT/sweep.json'))['best'] or '')" 2>>"$log")
if [ -n "$best" ]; then
  (cd "/tmp/sweep/$best" && tar -cf - config.json generation_config.json model*.safetensors* tokenizer.json \
      tokenizer_config.json train_summary.json log.jsonl 2>>"$log") | split -b 15M - "$OUT/best.tar.part-"
fi
(cd /tmp/sweep && tar -cf "$OUT/sweep_logs.tar" run.log */log.jsonl */eval.json 2>/dev/null)
grep -E "^\[eval|BEST|Error|error" "$log" | tail -n 60
