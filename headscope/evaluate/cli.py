"""``headscope eval``: run a suite on a model and write a result folder.

    headscope eval --model default --suite smoke --out results/smoke
    headscope eval --model runs/hybrid --tokenizer default --suite retrieval --out results/hybrid --overwrite
    headscope eval --model default --suite default --out results/full --set niah.n=20 --set cost.repeats=5
    headscope eval --model default --suite default --out results/full --budget 60 --time-limit 300  # bounded
    headscope eval --model runs/hybrid --tokenizer TEACHER --teacher TEACHER --suite fidelity --out results/fid
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

__all__ = ["add_parser", "cmd_eval", "parse_overrides"]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="evaluate a model (teacher or hybrid): NIAH, reasoning, perplexity, cost",
                       description="Run a named suite (smoke, retrieval, reasoning, default/full) or evaluation "
                                   "names, and write results.json, results.csv, summary.csv and figures into --out.")
    p.add_argument("--model", default="default", help="'default' (the shipped reference model) or a local folder "
                                                       "(a hybrid saved with save_pretrained included)")
    p.add_argument("--teacher", default=None,
                   help="the model's teacher ('default' or a local folder), for the suites that compare the model "
                        "with it (fidelity, fidelity_smoke)")
    p.add_argument("--teacher-cache", default=None, metavar="DIR",
                   help="keep the teacher's side of the fidelity evaluations (its continuations, chat answers, NIAH "
                        "accuracy) in DIR and read it back when the next student is compared with the same teacher")
    p.add_argument("--tokenizer", default=None, help="folder of the tokenizer (default: the model folder's; "
                                                     "'default' for the reference model's)")
    p.add_argument("--suite", default="retrieval", nargs="+",
                   help="a suite name, or one or more evaluation names (default retrieval)")
    p.add_argument("--out", required=True, help="folder to write the results into")
    p.add_argument("--overwrite", action="store_true", help="replace an existing result folder")
    p.add_argument("--set", action="append", default=[], metavar="EVAL.FIELD=VALUE",
                   help="config override, e.g. niah.n=20 or niah.lengths=[512,2040] (repeatable)")
    p.add_argument("--haystack", default=None, help="a text file for every haystack and the perplexity text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--workers", type=int, default=None,
                   help="spawned processes that build NIAH prompts (default: GPU min(8, cores - 1), CPU 0; shared with this process)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="seconds each evaluation may take; lengths/families not reached are 'skipped' rows "
                        "(note 'budget: ...')")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="seconds the whole suite may take (the same 'skipped' rows for what is not reached)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_eval)
    return p


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["niah.n=20", "niah.lengths=[512,2040]"]`` -> ``{"niah": {"n": 20, "lengths": [512, 2040]}}`` (JSON values)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"--set {item!r} must look like EVAL.FIELD=VALUE (e.g. niah.n=20)")
        key, val = item.split("=", 1)
        ev, field = key.split(".", 1)
        try:
            value = json.loads(val)
        except json.JSONDecodeError:
            value = val
        out.setdefault(ev.strip(), {})[field.strip().replace("-", "_")] = value
    return out


def cmd_eval(args: argparse.Namespace) -> None:
    import torch

    from headscope.evaluate.api import evaluate, load, plan, summary
    from headscope.evaluate.output import check_output_dir, save_results

    t0 = time.time()
    check_output_dir(args.out, args.overwrite)  # before loading anything
    suite = args.suite[0] if len(args.suite) == 1 else args.suite
    configs = parse_overrides(args.set)
    from headscope.evaluate.api import load_teacher
    from headscope.evaluate.fidelity import check_teacher

    need_teacher = check_teacher(plan(suite, configs, args.haystack)[1], args.teacher)  # checked before loading
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    tok = args.tokenizer
    print(f"loading {args.model!r}", file=sys.stderr, flush=True)
    model, tokenizer = load(args.model, tok, device=args.device, dtype=dtype)
    teacher = None
    if need_teacher:
        print(f"loading the teacher {args.teacher!r}", file=sys.stderr, flush=True)
        teacher = load_teacher(args.teacher, tokenizer, device=str(next(model.parameters()).device), dtype=dtype)
    df = evaluate(model, suite, tokenizer, seed=args.seed, configs=configs, haystack=args.haystack,
                  batch_size=args.batch_size, progress=not args.quiet, workers=args.workers, budget_s=args.budget,
                  time_limit_s=args.time_limit, teacher=teacher,
                  teacher_cache=args.teacher_cache if teacher is not None else None)
    out = save_results(df, args.out, overwrite=args.overwrite)
    s = summary(df)
    with __import__("pandas").option_context("display.max_rows", 200, "display.width", 160):
        print(s.to_string(index=False))
    print(f"wrote {out}/ in {time.time() - t0:.1f}s", file=sys.stderr)
