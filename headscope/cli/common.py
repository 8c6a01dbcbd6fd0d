"""What the ``headscope`` commands share: user errors, logging (rank 0 only under torchrun), loading the model
and score files, fusing and selecting, and the checks every output gets before any long work starts."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

class UsageError(ValueError):
    """A bad command line that argparse itself cannot catch."""


_RANK = 0  # this process's rank under torchrun (--shard); only rank 0 logs and writes files


def rank() -> int:
    """This process's rank under torchrun (--shard); 0 in a single process. Only rank 0 logs and writes files."""
    return _RANK


def log(msg: str) -> None:
    if _RANK == 0:
        print(msg, file=sys.stderr, flush=True)


def start_shard(args: argparse.Namespace) -> str | None:
    """--shard: start the process group from torchrun's environment (each rank on its own GPU when there are
    GPUs); returns the shard mode for ``score``, or None in a single process (nothing to split)."""
    global _RANK
    if getattr(args, "shard", None) is None:
        return None
    import os

    import torch

    from headscope.patching.sharded import init_from_env

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device is None:
        args.device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    if not init_from_env(args.device):
        log(f"--shard {args.shard}: one process (not started by torchrun): nothing to split")
        return None
    import torch.distributed as dist

    _RANK = dist.get_rank()
    log(f"--shard {args.shard}: {dist.get_world_size()} processes ({dist.get_backend()}); rank 0 writes the files")
    return args.shard


def stop_shard() -> None:
    global _RANK
    from headscope.patching.sharded import end_process_group

    end_process_group()  # every rank leaves together: no rank's exit cuts off another's last collective
    _RANK = 0


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def task_kwargs(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """--task-arg key=value pairs, plus --context-length for tasks whose config has that field."""
    import dataclasses

    from headscope.tasks import get_task

    out: dict[str, Any] = {}
    for item in getattr(args, "task_arg", None) or []:
        if "=" not in item:
            raise UsageError(f"--task-arg {item!r} must look like key=value (e.g. depth=0.5)")
        key, val = item.split("=", 1)
        out[key.strip().replace("-", "_")] = _value(val)
    ctx = getattr(args, "context_length", None)
    if ctx is not None and "context_length" not in out:
        cfg = getattr(get_task(name), "config", None)
        if cfg is not None and "context_length" in {f.name for f in dataclasses.fields(cfg)}:
            out["context_length"] = ctx
    return out


def load_model(spec: str, args: argparse.Namespace):
    import torch

    from headscope.reference import load_model

    from headscope.reference import check_device

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)
    log(f"loading model {spec!r} on {device} ({args.dtype})")
    return load_model(spec, dtype=dtype, device=device)


def model_config(spec: str | None):
    """Just the config of --model (for the mask's shape and fingerprint), without loading weights."""
    if spec is None:
        return None
    from transformers import AutoConfig

    from headscope.reference import DEFAULT_NAME, default_path

    path = default_path() if spec == DEFAULT_NAME else Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"--model {spec}: no config.json in {path}")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def shape_text(L: int, H: int) -> str:
    return f"{L} layers x {H} heads"


def load_scores(paths: Sequence[str]):
    import torch

    from headscope.results import HeadScores

    out = []
    for p in paths:
        if not Path(p).exists():
            raise FileNotFoundError(f"scores file {p} does not exist")
        try:
            s = HeadScores.from_json(p)
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise UsageError(f"{p} is not a headscope scores file ({err})") from None
        bad = ~torch.isfinite(s.per_sample_raw)  # [N, L, H]
        if bad.any():
            raise UsageError(f"{p} holds {int(bad.sum())} NaN/infinite score(s) (first at sample, layer, head "
                             f"{tuple(int(i) for i in bad.nonzero()[0])}): rescore that task; scores must be finite")
        out.append(s)
    return out


def fuse_scores(scores: list, combine_rule: str, stability: str, weights: list[float] | None, threshold: float):
    """Group score files by task, combine receiver+sender of a task, fuse tasks (one task: still weighted)."""
    from headscope.fusion import combine, fuse

    if any(s.kind == "fused" for s in scores):
        if len(scores) > 1:
            raise UsageError("a fused scores file already combines its tasks; pass it alone or pass the task files")
        return scores[0]
    by_task: dict[str, dict[str, Any]] = {}
    for s in scores:
        kind = "sender" if s.kind == "sender" else "receiver"
        slot = by_task.setdefault(s.task, {})
        if kind in slot:
            raise UsageError(f"two {kind} score files for task {s.task!r}; pass one per task (and kind)")
        slot[kind] = s
    per_task = {}
    for task, slot in by_task.items():
        if "receiver" not in slot:
            raise UsageError(f"task {task!r} has sender scores but no receiver scores; pass its receiver scores too")
        per_task[task] = combine(slot["receiver"], slot.get("sender"), rule=combine_rule) if "sender" in slot \
            else slot["receiver"]
    if weights is not None and len(weights) != len(per_task):
        raise UsageError(f"--weights has {len(weights)} values for {len(per_task)} tasks {list(per_task)}")
    return fuse(per_task, weights=weights, stability=stability, threshold=threshold)


def select_heads(fused, args: argparse.Namespace, model_or_config: Any):
    from headscope.selection import select

    budget = {"k": args.k, "fraction": args.fraction, "ratio": args.ratio}
    if all(v is None for v in budget.values()):
        budget["ratio"] = "7:1"
    seed = getattr(args, "tie_seed", None)
    return select(fused, strategy=args.strategy, seed=seed, model=model_or_config, **budget)


# ----------------------------------------------------------------------------- checks before long work

MASK_KIND, SCORES_KIND = "headscope.head_mask", "headscope.head_scores"


def check_out(path: str | Path, kind: str | None, args: argparse.Namespace, flag: str = "--out") -> Path:
    from headscope.io import check_output_path

    return check_output_path(path, kind=kind, overwrite=getattr(args, "overwrite", False), flag=flag)


def check_figure(path: str | None, args: argparse.Namespace, flag: str = "--plot") -> None:
    if path is None:
        return
    from headscope.plots import check_figure_path

    check_figure_path(path, overwrite=getattr(args, "overwrite", False), flag=flag)


def is_knockout_csv(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith("k,fraction,selection")
    except (OSError, UnicodeDecodeError):
        return False


def check_csv(path: str, args: argparse.Namespace, flag: str = "--out") -> None:
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"{flag} {p} is a folder; give a file path (e.g. {p / 'curve.csv'})")
    if p.suffix.lower() != ".csv":
        raise ValueError(f"{flag} {p}: the knockout table is a CSV file; give a path ending in .csv")
    if p.exists() and not is_knockout_csv(p) and not args.overwrite:
        raise FileExistsError(f"{flag} {p} is not a knockout CSV; refusing to overwrite it (pass --overwrite, or "
                              "choose another path)")


def check_budget(args: argparse.Namespace, model_or_config: Any, n_layers: int, n_heads: int) -> None:
    """Run the selection once on all-zero scores: every budget/strategy error surfaces before any scoring."""
    import warnings

    import torch

    from headscope.results import HeadScores

    if args.ratio is not None:
        from headscope.selection import parse_ratio

        parse_ratio(args.ratio)
    probe = HeadScores("budget-check", torch.zeros(1, n_layers, n_heads))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        select_heads(probe, args, model_or_config)

