"""Train the default reference model (Qwen3 architecture, ~7 M params) on text + NIAH + reasoning: a thin
caller of hybrid.train's loop (stage "pretrain"); the flags build a hybrid.train.TrainConfig.

GPU (one H200, ~7 minutes):
    python research/reference/train_reference.py --out runs/reference
    python research/reference/train_reference.py --out runs/textonly --text-only
CPU smoke / de-risk:
    python research/reference/train_reference.py --device cpu --tiny --max-steps 20 --out /tmp/ref_tiny \
        --corpus heldout

Batches are built on the fly (hybrid/train/data.py; --workers DataLoader workers). LR: linear warmup then
cosine, driven by the fraction of the time budget used (--max-minutes) or of --max-steps, whichever is
larger. Writes into --out: log.jsonl, training.html, checkpoints/ (every --ckpt-every steps and at the end;
--resume continues), run.json, and at the end the model (safetensors), tokenizer and train_summary.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=384)


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """"LO-HI" (or "N") -> (LO, HI); a clear error otherwise."""
    try:
        lo, _, hi = text.partition("-")
        return int(lo), int(hi or lo)
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give LO-HI, e.g. 2-8") from None


def make_probes(tokenizer, seq_len: int, n: int) -> dict:
    from headscope.tasks import get_task

    ctx = max(64, seq_len - 8)
    specs = {f"niah@{seq_len}": ("niah", dict(context_length=ctx, depth="uniform", haystack="heldout"))}
    if seq_len > 256:
        specs["niah@256"] = ("niah", dict(context_length=248, depth="uniform", haystack="heldout"))
    specs["multikey"] = ("niah_multikey", dict(context_length=ctx, depth="random", haystack="heldout", n_keys=4))
    if seq_len > 256:
        specs["multikey@256"] = ("niah_multikey", dict(context_length=248, depth="random", haystack="heldout",
                                                       n_keys=4))
    specs["reasoning"] = ("reasoning", {})
    specs["binding"] = ("binding", {})
    specs["two_hop"] = ("two_hop", {})
    probes = {}
    for i, (label, (name, cfg)) in enumerate(specs.items()):
        try:
            probes[label] = get_task(name, **cfg).tokenized(tokenizer, n, seed=10_001 + i)
        except Exception as err:  # probes are diagnostics only
            print(f"[probe] {label} skipped: {err}", file=sys.stderr)
    return probes


def probe_eval(seq_len: int, n: int):
    """A hybrid.train evaluation: greedy answer accuracy on fixed held-out probe sets."""
    def evaluate(ctx) -> dict:
        from headscope.ablation import answer_accuracy

        if "probes" not in ctx.cache:
            ctx.cache["probes"] = make_probes(ctx.tokenizer, seq_len, n)
        with ctx.autocast:
            return {f"eval_acc_{k}": round(answer_accuracy(ctx.model, p, batch_size=16), 3)
                    for k, p in ctx.cache["probes"].items()}
    return evaluate


def build_config(a):
    from hybrid.train import TrainConfig

    cpu = a.device == "cpu"
    seq_len = a.seq_len or (512 if a.tiny else 2048)
    tokens_per_batch = a.tokens_per_batch or (8 * seq_len if cpu else 32 * seq_len)
    steps = a.max_steps or 10_000_000  # a time budget alone: the step count only scales the schedule
    if not (a.max_steps or a.max_minutes):
        raise SystemExit("give --max-minutes or --max-steps")
    weights = dict(text=a.w_text, niah=a.w_niah, multikey=a.w_multikey, reasoning=a.w_reasoning, copy=a.w_copy)
    if a.text_only:
        weights = dict(text=1.0, niah=0.0, multikey=0.0, reasoning=0.0, copy=0.0)
    data = dict(corpus=str(a.corpus), haystack="train" if str(a.corpus).endswith("train.txt") else str(a.corpus),
                **weights, answer_weight=a.answer_weight, haystack_weight=a.haystack_weight,
                multikey_min_len=a.multikey_min_len, extra_queries=a.extra_queries, fast_niah=a.fast_niah,
                reasoning_families=[f.strip() for f in a.reasoning_families.split(",") if f.strip()],
                min_len=min(a.min_len, seq_len), ramp=a.ramp, max_keys=a.max_keys,
                binding_vars=list(parse_range(a.binding_vars, "--binding-vars")),
                workers=a.workers if a.workers is not None else (0 if cpu else 12))
    model = dict(TINY if a.tiny else {}, max_position_embeddings=max(2048, seq_len),
                 init_from=str(a.init_from) if a.init_from else None)
    stage = dict(name="pretrain", steps=steps, lr=a.lr or (3e-3 if a.tiny else 2e-3), seq_len=seq_len,
                 batch_size=tokens_per_batch // seq_len, warmup_steps=int(a.warmup * steps),
                 weight_decay=a.weight_decay, grad_clip=1.0, head_drop=a.head_drop, max_minutes=a.max_minutes)
    return TrainConfig.from_dict(dict(
        out=str(a.out), teacher=None, tokenizer=str(a.tokenizer), seed=a.seed, device=a.device, data=data,
        model=model, stages=[stage], log_every=a.log_every or (5 if cpu else 25),
        eval_every=a.probe_every or (25 if cpu else 250), eval="none", checkpoint_every=a.ckpt_every,
        threads=a.threads if cpu else 0, progress=not a.no_progress))


def main(argv: list[str] | None = None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=REPO / "headscope/weights/default",
                    help="folder with tokenizer.json (research/reference/train_tokenizer.py)")
    ap.add_argument("--corpus", default=str(REPO / "data/corpus/train.txt"),
                    help="a text file, or 'heldout' (the shipped held-out text: smoke runs only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="3 layers, hidden 128, seq 512: a CPU smoke run")
    ap.add_argument("--text-only", action="store_true", help="same model on text only (perplexity reference)")
    ap.add_argument("--max-minutes", type=float, default=0.0, help="training wall-clock budget (set-up excluded)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--ramp", type=float, default=0.3, help="fraction of the run for the length curriculum")
    ap.add_argument("--tokens-per-batch", type=int, default=None)
    ap.add_argument("--w-text", type=float, default=0.25)
    ap.add_argument("--w-niah", type=float, default=0.4)
    ap.add_argument("--w-multikey", type=float, default=0.15)
    ap.add_argument("--w-reasoning", type=float, default=0.2)
    ap.add_argument("--w-copy", type=float, default=0.1, help="repeated-snippet rows (induction data)")
    ap.add_argument("--answer-weight", type=float, default=5.0)
    ap.add_argument("--haystack-weight", type=float, default=1.0, help="loss weight of NIAH prompt tokens")
    ap.add_argument("--multikey-min-len", type=int, default=0,
                    help="> 0: pack multi-key prompts of lengths from this up to T into each multi-key row")
    ap.add_argument("--reasoning-families", default="arithmetic,binding,comparison,two_hop",
                    help="comma-separated; repeat a family to weight it, e.g. arithmetic,binding,binding")
    ap.add_argument("--extra-queries", type=int, default=0,
                    help="multi-key NIAH and binding examples ask up to this many more keys after the answer")
    ap.add_argument("--binding-vars", default="4-4", help="binding examples bind LO-HI variables (uniform)")
    ap.add_argument("--max-keys", type=int, default=6, help="most keyed needles in a multi-key NIAH prompt")
    ap.add_argument("--fast-niah", action="store_true",
                    help="NIAH prompts around corpus token windows (about the length; 4.2x cheaper, bench_data.py)")
    ap.add_argument("--head-drop", type=float, default=0.0,
                    help="probability of mean-replacing each head's output per row (hybrid/train/head_dropout.py)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this saved model folder (e.g. headscope/weights/default) with a fresh optimizer")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup", type=float, default=0.03, help="warmup as a fraction of the run")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--probe-every", type=int, default=None, help="held-out accuracy probes every N steps")
    ap.add_argument("--probe-n", type=int, default=32)
    ap.add_argument("--ckpt-every", type=int, default=500, help="checkpoint every N steps (and at the end)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from headscope.io import write_text
    from hybrid.train import run

    config = build_config(a)
    stage = config.stages[0]
    evaluate = None if a.text_only else probe_eval(stage.seq_len, a.probe_n)
    result = run(config, resume=a.resume, evaluate=evaluate)
    for f in result.model_path.iterdir():  # the model folder's files at the top of --out (eval_reference --model)
        os.replace(f, a.out / f.name)
    result.model_path.rmdir()
    last = {k: v for r in result.history for k, v in r.items()}
    final = {"step": last.get("step"), "minutes": last.get("minutes"), "tokens": last.get("tokens"),
             "params": sum(p.numel() for p in result.model.parameters()), "text_only": a.text_only,
             "config": config.to_dict(), **{k: v for k, v in last.items() if k.startswith("eval_acc_")}}
    write_text(a.out / "train_summary.json", json.dumps(final, indent=1))
    print(json.dumps({"final": final}, default=str), flush=True)


if __name__ == "__main__":
    main()
