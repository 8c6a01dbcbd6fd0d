"""Clean accuracy of a model on every headscope task: NIAH / multi-key NIAH per context length, the reasoning families.

    python research/task_accuracy.py --model smollm2-135m --dry-run                 # CPU: 512 tokens, 4 prompts
    python research/task_accuracy.py --model smollm2-135m --tasks arithmetic,binding,comparison,two_hop  # CPU
    python research/task_accuracy.py --model smollm2-135m --device cuda --dtype bfloat16 --n 20   # H200, to 8K

Clean accuracy = teacher-forced greedy exact match of the clean answer (headscope.ablation.answer_accuracy,
the same test score()'s clean_correct uses). A registry model's task defaults (headscope.zoo) are applied,
so the numbers are those of the task forms score() uses for that model. Prints one row per task x context
(reasoning prompts are short: one row each) and writes JSON with --out.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

CONTEXT_TASKS = ("niah", "niah_multikey")
FAMILIES = ("arithmetic", "binding", "comparison", "two_hop")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--tasks", default=",".join(CONTEXT_TASKS + FAMILIES))
    p.add_argument("--contexts", default="512,1024,2048,4096,8192", help="token lengths for the NIAH tasks")
    p.add_argument("--n", type=int, default=16, help="prompts per row")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dry-run", action="store_true", help="CPU smoke run: 4 prompts, contexts <= 512")
    p.add_argument("--out", default=None, help="JSON file for the table")
    a = p.parse_args(argv)
    a.tasks = tuple(t for t in a.tasks.split(",") if t)
    bad = [t for t in a.tasks if t not in CONTEXT_TASKS + FAMILIES]
    if bad:
        raise SystemExit(f"--tasks: unknown {bad}; choose from {CONTEXT_TASKS + FAMILIES}")
    try:
        a.contexts = tuple(int(c) for c in a.contexts.split(",") if c)
    except ValueError:
        raise SystemExit(f"--contexts={a.contexts!r}: give comma-separated token counts, e.g. 512,1024") from None
    if a.n < 1 or a.batch_size < 1 or any(c < 64 for c in a.contexts):
        raise SystemExit("--n and --batch-size must be >= 1 and every context >= 64 tokens")
    if a.dry_run:
        a.n, a.contexts = min(a.n, 4), tuple(c for c in a.contexts if c <= 512) or (512,)
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    import headscope
    from headscope.ablation import answer_accuracy
    from headscope.tasks import get_task
    from headscope.zoo import task_defaults

    t0 = time.time()
    model, tok = headscope.load_model(a.model, dtype=DTYPES[a.dtype], device=a.device)
    print(f"model {a.model} ({a.dtype} on {a.device}) loaded in {time.time() - t0:.0f} s; {a.n} prompts per row")
    print(f"{'task':>14} {'context':>7} {'prompt tokens':>13} {'clean acc':>9} {'s':>6}  task config")
    rows = []
    for task in a.tasks:
        contexts = a.contexts if task in CONTEXT_TASKS else (None,)
        for ctx in contexts:
            cfg = task_defaults(a.model, task)
            if ctx is not None:
                cfg = {**cfg, "context_length": ctx, "depth": "uniform"}
            t = time.time()
            pairs = get_task(task, **cfg).tokenized(tok, n=a.n, seed=a.seed)
            acc = answer_accuracy(model, pairs, batch_size=a.batch_size, pad_id=tok.pad_token_id or 0)
            lens = [p.prompt_len for p in pairs]
            row = {"task": task, "context": ctx, "n": len(pairs), "clean_accuracy": acc,
                   "prompt_tokens": [min(lens), max(lens)], "seconds": round(time.time() - t, 1), "config": cfg}
            rows.append(row)
            print(f"{task:>14} {ctx or '-':>7} {f'{min(lens)}..{max(lens)}':>13} {acc:>9.3f} {row['seconds']:>6.1f}  "
                  f"{ {k: v for k, v in cfg.items() if k not in ('context_length', 'depth')} or ''}", flush=True)
    if a.out:
        from headscope.io import write_text

        write_text(a.out, json.dumps({"model": a.model, "device": str(a.device), "dtype": a.dtype, "rows": rows},
                                     indent=1))
        print(f"-> {a.out}")
    return rows


if __name__ == "__main__":
    main()
