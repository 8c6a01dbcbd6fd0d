"""``headscope score`` (receiver scores per task) and ``headscope run`` (the whole method: receiver and sender
scores, fusion, selection, the mask)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from headscope.cli import common
from headscope.cli.common import (MASK_KIND, SCORES_KIND, UsageError, check_budget, check_figure, check_out, log, rank,
                                  select_heads, start_shard, task_kwargs)
from headscope.cli.estimate import Estimate

DEFAULT_SENDER_ROUNDS = 3


def _scores_paths(out: str, tasks: list[str]) -> list[Path]:
    p = Path(out)
    if len(tasks) == 1:
        return [p]
    return [p.with_name(f"{p.stem}.{t}{p.suffix or '.json'}") for t in tasks]


def _save_scores_paths(folder: str, tasks: list[str], senders: bool) -> list[Path]:
    d = Path(folder)
    names = [f"{t}.json" for t in tasks] + ([f"{t}.sender.json" for t in tasks] if senders else []) + ["fused.json"]
    return [d / n for n in names]


def _check_save_scores(folder: str | None, tasks: list[str], senders: bool, args: argparse.Namespace) -> None:
    if folder is None:
        return
    d = Path(folder)
    if d.exists() and not d.is_dir():
        raise FileExistsError(f"--save-scores {d} is an existing file; give a folder (it gets one JSON per task "
                              "and fused.json)")
    for p in _save_scores_paths(folder, tasks, senders):
        check_out(p, SCORES_KIND, args, flag="--save-scores")


def _score_kwargs(task: str, args: argparse.Namespace) -> dict[str, Any]:
    return dict(n_samples=args.n_samples, seed=args.seed, metric=args.metric, batch_size=args.batch_size,
                progress=not args.quiet, on_clean_failure=args.on_clean_failure,
                shard=getattr(args, "shard_mode", None), **task_kwargs(task, args))


def _receiver(model, tokenizer, task: str, args: argparse.Namespace, estimate: Estimate | None = None):
    from headscope.api import score

    t0 = time.time()
    s = score(model, task, tokenizer=tokenizer, backend=args.backend, **_score_kwargs(task, args))
    acc = s.clean_accuracy
    took = time.time() - t0
    log(f"scored {task}: {s.n_samples} samples in {took:.1f}s"
        + (f", clean accuracy {acc:.0%}" if acc is not None else "")
        + f"; top heads {', '.join(str(h) for h in s.top(5))}")
    if estimate is not None:
        estimate.first_step(task, took)
    return s


def _senders(model, tokenizer, task: str, receiver, args: argparse.Namespace, rounds: int):
    """Iterated path patching from ``receiver``'s top heads; returns (sender scores, combined scores)."""
    from headscope.senders import iterated_path_patching

    t0 = time.time()
    backend = "naive" if args.backend == "naive" else "hf"
    res = iterated_path_patching(model, task, tokenizer=tokenizer, receiver_scores=receiver, k=args.sender_k,
                                 max_rounds=rounds, rule=args.combine, backend=backend, **_score_kwargs(task, args))
    log(f"sender scores on {task}: {len(res.rounds)} round(s) in {time.time() - t0:.1f}s"
        f"{' (converged)' if res.converged else ''}; receivers {', '.join(str(h) for h in res.found())}")
    return res.sender, res.combined


def _run_tasks(args: argparse.Namespace) -> tuple[list[str], int]:
    tasks = args.task or (["niah"] if args.quick else ["niah", "reasoning"])
    rounds = 0 if args.quick else args.sender_rounds
    return tasks, rounds


def cmd_score(args: argparse.Namespace) -> None:
    paths = _scores_paths(args.out, args.task)
    for path in paths:
        check_out(path, SCORES_KIND, args)
    args.shard_mode = start_shard(args)
    model, tokenizer = common.load_model(args.model, args)
    estimate = Estimate(model, tokenizer, args.task, args, 0)
    for task, path in zip(args.task, paths):
        s = _receiver(model, tokenizer, task, args, estimate)
        if rank() == 0:
            s.to_json(path)
        log(f"wrote {path}")


def cmd_run(args: argparse.Namespace) -> None:
    from headscope.arch import describe
    from headscope.fusion import fuse

    t0 = time.time()
    tasks, rounds = _run_tasks(args)
    if args.ratio is not None:
        from headscope.selection import parse_ratio

        parse_ratio(args.ratio)
    out = check_out(args.out, MASK_KIND, args)
    _check_save_scores(args.save_scores, tasks, rounds > 0, args)
    check_figure(args.plot, args)
    if args.weights is not None and len(args.weights) != len(tasks):
        raise UsageError(f"--weights has {len(args.weights)} values for {len(tasks)} tasks {tasks}")
    args.shard_mode = start_shard(args)
    model, tokenizer = common.load_model(args.model, args)
    arch = describe(model)
    check_budget(args, model, arch.n_layers, arch.n_heads)
    estimate = Estimate(model, tokenizer, tasks, args, rounds)

    receivers, senders, per_task = {}, {}, {}
    for task in tasks:
        receivers[task] = _receiver(model, tokenizer, task, args, estimate)
        if rounds:
            senders[task], per_task[task] = _senders(model, tokenizer, task, receivers[task], args, rounds)
        else:
            per_task[task] = receivers[task]
    weights = None if args.weights is None else dict(zip(tasks, args.weights))
    fused = fuse(per_task, weights=weights, stability=args.stability, threshold=args.threshold)
    mask = select_heads(fused, args, model)
    mask.settings.update({"model": args.model, "tasks": tasks, "n_samples": args.n_samples,
                          "context_length": args.context_length, "sender_rounds": rounds,
                          "method": "receiver scores" if not rounds else
                          "receiver + sender scores (iterated path patching), combined per task"})
    if rank() != 0:  # every rank holds the same gathered scores; rank 0 writes them
        return
    mask.to_json(out)  # the mask first: a figure that fails below costs no scoring
    if args.save_scores:
        paths = iter(_save_scores_paths(args.save_scores, tasks, rounds > 0))
        for s in [*receivers.values(), *senders.values(), fused]:
            s.to_json(next(paths))
        log(f"wrote scores to {args.save_scores}/")
    print(mask.summary())
    log(f"wrote {out} in {time.time() - t0:.1f}s")
    if args.plot:
        from headscope.plots import PngExportError, heatmap, save

        try:
            log(f"wrote {save(heatmap(fused, mask=mask, title='fused head scores, FA heads marked'), args.plot)}")
        except PngExportError as err:
            raise PngExportError(f"{err} (the mask was written to {out})") from None

