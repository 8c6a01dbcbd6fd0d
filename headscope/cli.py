"""The ``headscope`` command line: score heads, fuse and select them into a mask, knock them out, plot.

    headscope run --model default --out mask.json              # the whole method (NIAH + reasoning, senders)
    headscope run --model default --quick --out mask.json      # receiver scores on NIAH only
    headscope score --model default --task niah --n-samples 8 --context-length 1024 --out niah.json
    headscope select --scores niah.json reasoning.json --ratio 7:1 --model default --out mask.json
    headscope knockout --model default --scores niah.json --out curve.csv --plot curve.html
    headscope plot heatmap --in niah.json --out niah.html
    headscope eval --model default --suite smoke --out results/smoke

User errors (bad arguments, missing files, unknown tasks, a model the data do not fit) print one
line ``headscope: error: ...`` and exit with status 2; ``--debug`` shows the traceback instead.
Every output is checked before any scoring starts (a folder, a wrong suffix, an existing file that is not
an artifact of the same kind: pass ``--overwrite``) and written atomically (headscope.io).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "build_parser"]


class UsageError(ValueError):
    """A bad command line that argparse itself cannot catch."""


# ----------------------------------------------------------------------------- helpers

_RANK = 0  # this process's rank under torchrun (--shard); only rank 0 logs and writes files


def _log(msg: str) -> None:
    if _RANK == 0:
        print(msg, file=sys.stderr, flush=True)


def _start_shard(args: argparse.Namespace) -> str | None:
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
        _log(f"--shard {args.shard}: one process (not started by torchrun): nothing to split")
        return None
    import torch.distributed as dist

    _RANK = dist.get_rank()
    _log(f"--shard {args.shard}: {dist.get_world_size()} processes ({dist.get_backend()}); rank 0 writes the files")
    return args.shard


def _stop_shard() -> None:
    global _RANK
    from headscope.patching.sharded import end_process_group

    end_process_group()  # every rank leaves together: no rank's exit cuts off another's last collective
    _RANK = 0


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _task_kwargs(name: str, args: argparse.Namespace) -> dict[str, Any]:
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


def _load_model(spec: str, args: argparse.Namespace):
    import torch

    from headscope.reference import load_model

    from headscope.reference import check_device

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)
    _log(f"loading model {spec!r} on {device} ({args.dtype})")
    return load_model(spec, dtype=dtype, device=device)


def _model_config(spec: str | None):
    """Just the config of --model (for the mask's shape and fingerprint), without loading weights."""
    if spec is None:
        return None
    from transformers import AutoConfig

    from headscope.reference import DEFAULT_NAME, default_path

    path = default_path() if spec == DEFAULT_NAME else Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"--model {spec}: no config.json in {path}")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def _load_scores(paths: Sequence[str]):
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


def _fused(scores: list, combine_rule: str, stability: str, weights: list[float] | None, threshold: float):
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


def _select(fused, args: argparse.Namespace, model_or_config: Any):
    from headscope.selection import select

    budget = {"k": args.k, "fraction": args.fraction, "ratio": args.ratio}
    if all(v is None for v in budget.values()):
        budget["ratio"] = "7:1"
    seed = getattr(args, "tie_seed", None)
    return select(fused, strategy=args.strategy, seed=seed, model=model_or_config, **budget)


def _summary(mask) -> str:
    return mask.summary()


# ----------------------------------------------------------------------------- checks before long work

MASK_KIND, SCORES_KIND = "headscope.head_mask", "headscope.head_scores"
DEFAULT_SENDER_ROUNDS = 3


def _check_out(path: str | Path, kind: str | None, args: argparse.Namespace, flag: str = "--out") -> Path:
    from headscope.io import check_output_path

    return check_output_path(path, kind=kind, overwrite=getattr(args, "overwrite", False), flag=flag)


def _check_figure(path: str | None, args: argparse.Namespace, flag: str = "--plot") -> None:
    if path is None:
        return
    from headscope.plots import check_figure_path

    check_figure_path(path, overwrite=getattr(args, "overwrite", False), flag=flag)


def _is_knockout_csv(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith("k,fraction,selection")
    except (OSError, UnicodeDecodeError):
        return False


def _check_csv(path: str, args: argparse.Namespace, flag: str = "--out") -> None:
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"{flag} {p} is a folder; give a file path (e.g. {p / 'curve.csv'})")
    if p.suffix.lower() != ".csv":
        raise ValueError(f"{flag} {p}: the knockout table is a CSV file; give a path ending in .csv")
    if p.exists() and not _is_knockout_csv(p) and not args.overwrite:
        raise FileExistsError(f"{flag} {p} is not a knockout CSV; refusing to overwrite it (pass --overwrite, or "
                              "choose another path)")


def _check_budget(args: argparse.Namespace, model_or_config: Any, n_layers: int, n_heads: int) -> None:
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
        _select(probe, args, model_or_config)


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
        _check_out(p, SCORES_KIND, args, flag="--save-scores")


# ----------------------------------------------------------------------------- time estimate

# Scoring work per pair, in units of one timed forward of a head-batch (n_heads copies of the prompt) per layer:
# the fast receiver path (prefix reuse, layer skip) and one path-patching round (senders below the last receiver
# layer only). Measured as single-thread CPU time on the reference model: receivers 0.28 (NIAH, 1024 tokens) and
# 0.32 (reasoning), one sender round 0.07 (NIAH) and 0.17 (reasoning). The estimate is printed as "about".
RECEIVER_FORWARDS_PER_LAYER = 0.3
SENDER_FORWARDS_PER_LAYER = 0.1


def _forward_seconds(model, ids, batch: int) -> float:
    import torch

    x = ids[None].expand(batch, -1).to(next(model.parameters()).device)  # [B, T]
    best = float("inf")
    with torch.inference_mode():
        model(input_ids=x[:1, :8])  # warm-up
        for _ in range(2):  # the faster of two: a first call's allocations are not scoring time
            t0 = time.perf_counter()
            model(input_ids=x)
            best = min(best, time.perf_counter() - t0)
    return best


def _estimate(model, tokenizer, tasks: list[str], args: argparse.Namespace,
              sender_rounds: int) -> dict[str, tuple[float, float]]:
    """About how long scoring takes, per task (receiver seconds, sender seconds): one timed head-batch forward
    per task, times the forwards the work needs."""
    import torch

    from headscope.arch import describe
    from headscope.tasks import get_task

    arch = describe(model)
    out: dict[str, tuple[float, float]] = {}
    for task in tasks:
        pair = get_task(task, **_task_kwargs(task, args)).tokenized(tokenizer, 1, args.seed)[0]
        ids = torch.as_tensor(pair.clean_ids)  # [T]
        t_batch = _forward_seconds(model, ids, arch.n_heads)
        per_layer = args.n_samples * arch.n_layers * t_batch
        out[task] = (per_layer * RECEIVER_FORWARDS_PER_LAYER, per_layer * sender_rounds * SENDER_FORWARDS_PER_LAYER)
    return out


def _fmt_seconds(sec: float) -> str:
    if sec < 90:
        return f"{sec:.0f} s"
    if sec < 5400:
        return f"{sec / 60:.1f} min"
    return f"{sec / 3600:.1f} h"


class _Estimate:
    """The time estimate of a scoring command: printed before scoring from one timed forward per task, then
    once more from the first measured step (the first task's receiver scores), which holds whatever else is
    running on the same cores."""

    def __init__(self, model, tokenizer, tasks: list[str], args: argparse.Namespace, sender_rounds: int):
        t0 = time.time()
        self.parts = _estimate(model, tokenizer, tasks, args, sender_rounds)  # {task: (receiver s, sender s)}
        self.revised = False
        what = "receiver" + (f" + sender ({sender_rounds} rounds max)" if sender_rounds else "") + " scores"
        total = sum(r + s for r, s in self.parts.values())
        _log(f"estimated time: about {_fmt_seconds(total)} for {what} on {', '.join(tasks)} with {args.n_samples} "
             f"samples each (timed in {time.time() - t0:.1f}s on the cores as they are now; re-estimated after the "
             "first step; Ctrl-C stops)")

    def first_step(self, task: str, seconds: float) -> None:
        """After the first task's receiver scores took ``seconds``: the rest, scaled by measured / estimated."""
        if self.revised:
            return
        self.revised = True
        est = self.parts[task][0]
        rest = sum(r + s for r, s in self.parts.values()) - est
        if rest <= 0 or est <= 0:
            return
        ratio = seconds / est
        _log(f"re-estimated from the first step ({task} receiver scores: {seconds:.1f}s, estimated {est:.1f}s): "
             f"about {_fmt_seconds(rest * ratio)} left")


def _print_estimate(model, tokenizer, tasks: list[str], args: argparse.Namespace,
                    sender_rounds: int) -> _Estimate:
    return _Estimate(model, tokenizer, tasks, args, sender_rounds)


# ----------------------------------------------------------------------------- scoring

def _score_kwargs(task: str, args: argparse.Namespace) -> dict[str, Any]:
    return dict(n_samples=args.n_samples, seed=args.seed, metric=args.metric, batch_size=args.batch_size,
                progress=not args.quiet, on_clean_failure=args.on_clean_failure,
                shard=getattr(args, "shard_mode", None), **_task_kwargs(task, args))


def _receiver(model, tokenizer, task: str, args: argparse.Namespace, estimate: _Estimate | None = None):
    from headscope.api import score

    t0 = time.time()
    s = score(model, task, tokenizer=tokenizer, backend=args.backend, **_score_kwargs(task, args))
    acc = s.clean_accuracy
    took = time.time() - t0
    _log(f"scored {task}: {s.n_samples} samples in {took:.1f}s"
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
    _log(f"sender scores on {task}: {len(res.rounds)} round(s) in {time.time() - t0:.1f}s"
         f"{' (converged)' if res.converged else ''}; receivers {', '.join(str(h) for h in res.found())}")
    return res.sender, res.combined


def _run_tasks(args: argparse.Namespace) -> tuple[list[str], int]:
    tasks = args.task or (["niah"] if args.quick else ["niah", "reasoning"])
    rounds = 0 if args.quick else args.sender_rounds
    return tasks, rounds


# ----------------------------------------------------------------------------- commands

def cmd_score(args: argparse.Namespace) -> None:
    paths = _scores_paths(args.out, args.task)
    for path in paths:
        _check_out(path, SCORES_KIND, args)
    args.shard_mode = _start_shard(args)
    model, tokenizer = _load_model(args.model, args)
    estimate = _print_estimate(model, tokenizer, args.task, args, 0)
    for task, path in zip(args.task, paths):
        s = _receiver(model, tokenizer, task, args, estimate)
        if _RANK == 0:
            s.to_json(path)
        _log(f"wrote {path}")


_FINGERPRINT_KEYS = ("config_fingerprint", "fingerprint", "model_fingerprint")


def _recorded_model(scores: list) -> dict[str, Any] | None:
    """The model the scores files record (``settings``: model name or path, fingerprint, model type; the
    scores' own shape and KV heads), or None when none records one. Files that record different models
    are refused."""
    found: dict[str, dict[str, Any]] = {}
    for s in scores:
        st = s.settings or {}
        model = st.get("model")
        nested = model if isinstance(model, dict) else {}
        name = nested.get("name") or nested.get("name_or_path") if nested else model
        fp = next((v for src in (st, nested) for k in _FINGERPRINT_KEYS if (v := src.get(k))), None)
        if not name and not fp:
            continue
        rec = {"name": str(name) if name else None, "fingerprint": str(fp) if fp else None,
               "model_type": st.get("model_type") or nested.get("model_type"),
               "n_layers": s.n_layers, "n_heads": s.n_heads, "n_kv_heads": s.n_kv_heads,
               "recorded_shape": (st.get("n_layers"), st.get("n_heads"))}
        found[s.task + "/" + s.kind] = rec
    if not found:
        return None
    fps = {r["fingerprint"] for r in found.values() if r["fingerprint"]}
    if len(fps) > 1:
        raise UsageError(f"the scores files come from different models (config fingerprints {sorted(fps)}); "
                         "pass scores of one model, and --model for it")
    rec = next(iter(found.values()))
    if fps:
        rec = next(r for r in found.values() if r["fingerprint"])
    return rec


def _recorded_config(rec: dict[str, Any]):
    """The local config of the recorded model when it is still on disk and still matches the recorded
    fingerprint, else None."""
    from headscope.mask import fingerprint_matches

    if not rec["name"]:
        return None
    try:
        cfg = _model_config(rec["name"])
    except Exception:  # not a local folder (a hub name, a moved folder): the recorded fields are used instead
        return None
    if rec["fingerprint"] and not fingerprint_matches(cfg, rec["fingerprint"]):
        return None
    return cfg


def _shape_text(L: int, H: int) -> str:
    return f"{L} layers x {H} heads"


def _check_scores_fit_model(fused, cfg, spec: str, rec: dict[str, Any] | None, recorded: bool = False) -> None:
    from headscope.mask import model_shape

    shape = model_shape(cfg)
    ml, mh = shape["num_hidden_layers"], shape["num_attention_heads"]
    if (fused.n_layers, fused.n_heads) == (ml, mh):
        return
    if recorded:
        raise UsageError(f"the scores are {_shape_text(fused.n_layers, fused.n_heads)} but the model they record, "
                         f"{spec}, has {_shape_text(ml, mh)}: rescore that model (headscope score --model {spec}), "
                         "or pass --model the scores came from")
    came = f" ({rec['name']}, recorded in the scores)" if rec and rec.get("name") else ""
    raise UsageError(f"the scores are {_shape_text(fused.n_layers, fused.n_heads)} but --model {spec} has "
                     f"{_shape_text(ml, mh)}: pass scores of this model (headscope score --model {spec}), or "
                     f"--model the scores came from{came}")


def _select_for_recorded_model(fused, args: argparse.Namespace, rec: dict[str, Any] | None):
    """select without --model: the mask carries the model the scores record (its shape, KV heads and
    fingerprint, from its local config when that still matches, else from the recorded fields)."""
    import dataclasses

    if rec is None:
        _log(f"select: no --model and the scores record no model: the mask is for "
             f"{_shape_text(fused.n_layers, fused.n_heads)} (the scores' shape) without a config fingerprint; "
             "pass --model to record the model")
        return _select(fused, args, None)
    cfg = _recorded_config(rec)
    if cfg is not None:
        _check_scores_fit_model(fused, cfg, rec["name"], rec, recorded=True)
        mask = _select(fused, args, cfg)
    else:
        rl, rh = rec["recorded_shape"]
        if rl is not None and rh is not None and (int(rl), int(rh)) != (fused.n_layers, fused.n_heads):
            raise UsageError(f"the scores are {_shape_text(fused.n_layers, fused.n_heads)} but record a model "
                             f"of {_shape_text(int(rl), int(rh))} ({rec['name'] or 'unnamed'}): the file was edited "
                             "or mixed up; rescore, or pass --model the scores came from")
        mask = _select(fused, args, None)
        if rec["fingerprint"] or rec["model_type"]:
            mask = dataclasses.replace(mask, fingerprint=rec["fingerprint"] or mask.fingerprint,
                                       model_type=rec["model_type"] or mask.model_type)
    mask.settings["model"] = rec["name"]
    mask.settings["model_from"] = "the scores' settings (no --model)"
    kv = f", {mask.n_kv_heads} KV heads" if mask.n_kv_heads is not None else ""
    fp = f", config fingerprint {mask.fingerprint}" if mask.fingerprint else ", no config fingerprint"
    src = "its local config" if cfg is not None else "the fields the scores record"
    _log(f"select: no --model: the mask is for the model the scores record, {rec['name'] or 'unnamed'} "
         f"({_shape_text(mask.n_layers, mask.n_heads)}{kv}{fp}; from {src})")
    return mask


def cmd_select(args: argparse.Namespace) -> None:
    _check_out(args.out, MASK_KIND, args)
    scores = _load_scores(args.scores)
    rec = _recorded_model(scores)
    fused = _fused(scores, args.combine, args.stability, args.weights, args.threshold)
    if args.model is not None:
        cfg = _model_config(args.model)
        _check_scores_fit_model(fused, cfg, args.model, rec)
        mask = _select(fused, args, cfg)
    else:
        mask = _select_for_recorded_model(fused, args, rec)
    mask.to_json(args.out)
    print(_summary(mask))
    _log(f"wrote {args.out}")


def cmd_run(args: argparse.Namespace) -> None:
    from headscope.arch import describe
    from headscope.fusion import fuse

    t0 = time.time()
    tasks, rounds = _run_tasks(args)
    if args.ratio is not None:
        from headscope.selection import parse_ratio

        parse_ratio(args.ratio)
    out = _check_out(args.out, MASK_KIND, args)
    _check_save_scores(args.save_scores, tasks, rounds > 0, args)
    _check_figure(args.plot, args)
    if args.weights is not None and len(args.weights) != len(tasks):
        raise UsageError(f"--weights has {len(args.weights)} values for {len(tasks)} tasks {tasks}")
    args.shard_mode = _start_shard(args)
    model, tokenizer = _load_model(args.model, args)
    arch = describe(model)
    _check_budget(args, model, arch.n_layers, arch.n_heads)
    estimate = _print_estimate(model, tokenizer, tasks, args, rounds)

    receivers, senders, per_task = {}, {}, {}
    for task in tasks:
        receivers[task] = _receiver(model, tokenizer, task, args, estimate)
        if rounds:
            senders[task], per_task[task] = _senders(model, tokenizer, task, receivers[task], args, rounds)
        else:
            per_task[task] = receivers[task]
    weights = None if args.weights is None else dict(zip(tasks, args.weights))
    fused = fuse(per_task, weights=weights, stability=args.stability, threshold=args.threshold)
    mask = _select(fused, args, model)
    mask.settings.update({"model": args.model, "tasks": tasks, "n_samples": args.n_samples,
                          "context_length": args.context_length, "sender_rounds": rounds,
                          "method": "receiver scores" if not rounds else
                          "receiver + sender scores (iterated path patching), combined per task"})
    if _RANK != 0:  # every rank holds the same gathered scores; rank 0 writes them
        return
    mask.to_json(out)  # the mask first: a figure that fails below costs no scoring
    if args.save_scores:
        paths = iter(_save_scores_paths(args.save_scores, tasks, rounds > 0))
        for s in [*receivers.values(), *senders.values(), fused]:
            s.to_json(next(paths))
        _log(f"wrote scores to {args.save_scores}/")
    print(_summary(mask))
    _log(f"wrote {out} in {time.time() - t0:.1f}s")
    if args.plot:
        from headscope.plots import PngExportError, heatmap, save

        try:
            _log(f"wrote {save(heatmap(fused, mask=mask, title='fused head scores, FA heads marked'), args.plot)}")
        except PngExportError as err:
            raise PngExportError(f"{err} (the mask was written to {out})") from None


def cmd_knockout(args: argparse.Namespace) -> None:
    from headscope.io import atomic_write
    from headscope.knockout import auc, knockout_curve

    _check_csv(args.out, args)
    _check_figure(args.plot, args)
    scores = _load_scores(args.scores)
    fused = scores[0] if len(scores) == 1 else _fused(scores, "max", "none", None, 0.1)
    real = [s.task for s in scores if s.kind != "fused"]
    task = args.task or (real[0] if len(set(real)) == 1 else None)
    if task is None:
        raise UsageError("pass --task: the scores cover several tasks, so the task to knock out on is ambiguous")
    model, tokenizer = _load_model(args.model, args)
    df = knockout_curve(model, task, fused, tokenizer=tokenizer, max_fraction=args.max_fraction, kind=args.kind,
                        n_random=args.n_random, n_samples=args.n_samples, seed=args.seed, metric=args.metric,
                        batch_size=args.batch_size or 8, progress=not args.quiet, **_task_kwargs(task, args))
    with atomic_write(args.out) as f:
        df.to_csv(f, index=False)
    a = auc(df)
    print(f"knockout on {task} ({args.kind}): mean accuracy top-k {a['top']:.3f}, random {a['random']:.3f}, "
          f"gap {a['gap']:.3f}")
    _log(f"wrote {args.out}")
    if args.plot:
        from headscope.plots import knockout_plot, save

        _log(f"wrote {save(knockout_plot(df, title=f'knockout on {task} ({args.kind})'), args.plot)}")


_SIMILARITY_EXPECTED = ("a layer-similarity CSV (a square matrix with the layer names as its first column and "
                        "header, e.g. layer_similarity(model).to_csv('sim.csv'))")


def _json_kind(src: Path) -> str | None:
    """What a JSON input is ("a headscope scores file", ...), or None when it is not JSON."""
    try:
        data = json.loads(src.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return None
    schema = data.get("schema") if isinstance(data, dict) else None
    return {SCORES_KIND: "a headscope scores JSON file", MASK_KIND: "a headscope head-mask JSON file"}.get(
        schema, "a JSON file")


def _similarity_csv(src: Path):
    """plot similarity's input, refused with what was expected and what was given."""
    import pandas as pd

    hint = {"a headscope scores JSON file": " (plot scores with `headscope plot heatmap` or `plot stability`)",
            "a headscope head-mask JSON file": " (plot a mask with `headscope plot heatmap`)"}
    kind = _json_kind(src)
    if kind is not None:
        raise UsageError(f"plot similarity reads {_SIMILARITY_EXPECTED}; {src} is {kind}{hint.get(kind, '')}")
    if _is_knockout_csv(src):
        raise UsageError(f"plot similarity reads {_SIMILARITY_EXPECTED}; {src} is a knockout CSV (plot it with "
                         "`headscope plot knockout`)")
    try:
        df = pd.read_csv(src, index_col=0)
    except (ValueError, UnicodeDecodeError) as err:
        raise UsageError(f"plot similarity reads {_SIMILARITY_EXPECTED}; {src} is not a readable CSV "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    if df.shape[0] != df.shape[1] or df.shape[0] == 0:
        raise UsageError(f"plot similarity reads {_SIMILARITY_EXPECTED}; {src} holds a {df.shape[0]} x "
                         f"{df.shape[1]} table (after its first column), not a square matrix")
    bad = [c for c in df.columns if not pd.api.types.is_numeric_dtype(df[c])]
    if bad:
        raise UsageError(f"plot similarity reads {_SIMILARITY_EXPECTED}; {src} has non-numeric column(s) "
                         f"{bad[:3]}")
    return df


def cmd_plot(args: argparse.Namespace) -> None:
    import pandas as pd
    import torch

    from headscope import plots

    _check_figure(args.out, args, flag="--out")
    src = Path(args.inp)
    if not src.exists():
        raise FileNotFoundError(f"input file {src} does not exist")
    if args.figure == "heatmap":
        from headscope.mask import HeadMask

        mask = HeadMask.from_json(args.mask) if args.mask else None
        try:
            data = json.loads(src.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UsageError(f"{src} is not a scores or head-mask JSON file") from None
        if data.get("schema") == "headscope.head_mask":
            inp = HeadMask.from_dict(data)
            if inp.scores is None:
                raise UsageError(f"{src} is a head mask without scores; plot its scores file instead")
            mask = mask or inp  # --mask marks its FA heads over the input mask's scores
            if (mask.n_layers, mask.n_heads) != (inp.n_layers, inp.n_heads):
                raise UsageError(f"--mask {args.mask} is for {_shape_text(mask.n_layers, mask.n_heads)} but --in "
                                 f"{src} holds scores of {_shape_text(inp.n_layers, inp.n_heads)}, so its FA heads "
                                 "would be marked outside the map: pass the mask selected from these scores (or "
                                 "the scores of the mask's model)")
            fig = plots.heatmap(torch.tensor(inp.scores), mask=mask,
                                n_kv_heads=inp.n_kv_heads, title=args.title or "mask scores, FA heads marked")
        else:
            scores = _load_scores([str(src)])[0]
            if mask is not None and (mask.n_layers, mask.n_heads) != (scores.n_layers, scores.n_heads):
                raise UsageError(f"--mask {args.mask} is for {_shape_text(mask.n_layers, mask.n_heads)} but --in "
                                 f"{src} holds scores of {_shape_text(scores.n_layers, scores.n_heads)}, so its FA "
                                 "heads would be marked outside the map: pass the mask selected from these scores "
                                 "(or the scores of the mask's model)")
            fig = plots.heatmap(scores, mask=mask, title=args.title)
    elif args.figure == "knockout":
        fig = plots.knockout_plot(pd.read_csv(src), band=args.band, title=args.title)
    elif args.figure == "stability":
        if src.suffix == ".json":
            from headscope.stability import ranking_stability

            df = ranking_stability(_load_scores([str(src)])[0], k=args.k, seed=args.seed)
        else:
            df = pd.read_csv(src)
        fig = plots.stability_plot(df, title=args.title)
    else:
        fig = plots.similarity_plot(_similarity_csv(src), title=args.title or
                                    "residual-stream cosine similarity between layers")
    _log(f"wrote {plots.save(fig, args.out)}")


# ----------------------------------------------------------------------------- parser

def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (the shipped reference model, the default) or a local Hugging Face folder")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _add_overwrite(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing output files that are not headscope outputs of the same kind")


def _add_tasks(p: argparse.ArgumentParser, multiple: bool = True, default_help: str = "niah") -> None:
    if multiple:
        p.add_argument("--task", action="append", default=None,
                       help="task to score (repeatable): niah, niah_multikey, arithmetic, binding, comparison, "
                            f"two_hop, reasoning (default: {default_help})")
    p.add_argument("--n-samples", type=int, default=8, help="prompt pairs per task (default 8)")
    p.add_argument("--context-length", type=int, default=None,
                   help="prompt length in tokens, for tasks that have one (NIAH; default: the task's, 1024)")
    p.add_argument("--task-arg", action="append", metavar="KEY=VALUE", help="extra task option, e.g. depth=0.5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric", default="logit_diff", choices=["logit_diff", "logprob"])
    p.add_argument("--batch-size", type=int, default=None)


def _add_score_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", help="scoring backend (default auto)")
    p.add_argument("--on-clean-failure", default="warn", choices=["warn", "drop", "error"],
                   help="when the model gets under half of the clean prompts right: warn (default), score only "
                        "the pairs it solves (drop), or stop (error)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--shard", choices=["heads", "samples", "auto"], default=None,
                   help="under torchrun (`torchrun --nproc_per_node N -m headscope ...`): split the scoring over "
                        "the processes (one GPU each, or gloo on CPUs) by heads or by samples; rank 0 writes")


def _add_selection(p: argparse.ArgumentParser) -> None:
    from headscope.fusion import COMBINE_RULES, DEFAULT_THRESHOLD, STABILITY_METHODS
    from headscope.selection import DEFAULT_STRATEGY, STRATEGIES

    g = p.add_mutually_exclusive_group()
    g.add_argument("--k", type=int, help="number of full-attention heads")
    g.add_argument("--fraction", type=float, help="fraction of heads kept as full attention, in (0, 1]")
    g.add_argument("--ratio", help="LA:FA ratio, e.g. 7:1 (the default when no budget is given)")
    p.add_argument("--strategy", default=DEFAULT_STRATEGY, choices=STRATEGIES,
                   help="global top-K; global top-K with >= 1 FA head per layer (default); top-K/L per layer")
    p.add_argument("--stability", default="frac", choices=STABILITY_METHODS,
                   help="per-task stability weighting (default frac: mean x fraction of samples > threshold)")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"'important on a sample' threshold for --stability frac (default {DEFAULT_THRESHOLD})")
    p.add_argument("--weights", type=float, nargs="+", help="task weights, in task order (default equal)")
    p.add_argument("--combine", default="max", choices=COMBINE_RULES,
                   help="how a task's receiver and sender scores combine (default max)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headscope", description=(
        "Find the attention heads a model's retrieval and reasoning causally depend on, and pick the ones to "
        "keep as full attention in a head-level hybrid."))
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="score -> fuse -> select -> mask.json in one go",
                       description="The whole method: receiver scores and sender scores (iterated path patching) "
                                   "on NIAH and the reasoning tasks, stability-weighted fusion, selection; writes "
                                   "the mask. --quick: receiver scores on NIAH only.")
    _add_model(p)
    _add_tasks(p, default_help="niah and reasoning; with --quick: niah")
    _add_score_opts(p)
    p.add_argument("--quick", action="store_true",
                   help="receiver scores only, on NIAH only (unless --task is given): about 4x faster")
    p.add_argument("--sender-rounds", type=int, default=DEFAULT_SENDER_ROUNDS,
                   help=f"iterated path patching rounds per task (default {DEFAULT_SENDER_ROUNDS}; 0: receiver "
                        "scores only)")
    p.add_argument("--sender-k", type=int, default=None,
                   help="receivers per path-patching round (default 2%% of all heads, at least 1)")
    _add_selection(p)
    p.add_argument("--out", default="mask.json", help="head-mask JSON to write (default mask.json)")
    p.add_argument("--save-scores", metavar="DIR", help="also write each task's receiver (and sender) scores and "
                                                        "the fused scores into this folder")
    p.add_argument("--plot", metavar="FILE", help="also write a heatmap of the fused scores (.html or .png)")
    _add_overwrite(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("score", help="causal receiver scores of every head on one or more tasks",
                       description="Score every head by activation patching; one JSON file per task.")
    _add_model(p)
    _add_tasks(p)
    _add_score_opts(p)
    p.add_argument("--out", required=True,
                   help="scores JSON; with several tasks, OUT's stem gets the task name (scores.niah.json, ...)")
    _add_overwrite(p)
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("select", help="fuse score files and select FA heads into a mask",
                       description="Fuse score files (one per task; a task's receiver and sender files are "
                                   "combined) and select the full-attention heads.")
    p.add_argument("--scores", nargs="+", required=True, help="scores JSON files (from `headscope score`)")
    _add_selection(p)
    p.add_argument("--seed", dest="tie_seed", type=int, default=None, help="random tie-breaking among equal scores")
    p.add_argument("--model", default=None, help="'default' or a local folder: record its shape and fingerprint "
                                                 "(default: the model the scores record, when they record one)")
    p.add_argument("--out", required=True, help="head-mask JSON to write")
    _add_overwrite(p)
    p.set_defaults(func=cmd_select)

    p = sub.add_parser("knockout", help="accuracy as the top-k heads (vs random heads) are knocked out",
                       description="Knock out the top-k heads by score and as many random heads; write a CSV.")
    _add_model(p)
    p.add_argument("--scores", nargs="+", required=True, help="scores JSON file(s); several are fused")
    p.add_argument("--task", default=None, help="task to evaluate on (default: the scores' task)")
    _add_tasks(p, multiple=False)
    p.add_argument("--kind", default="patch", choices=["patch", "mean", "zero"],
                   help="knockout: patch (default, the paper's: a head takes its activation from the corrupted "
                        "prompt), mean (its mean activation over the prompts) or zero")
    p.add_argument("--n-random", type=int, default=5, help="random head sets per k (default 5)")
    p.add_argument("--max-fraction", type=float, default=0.1, help="largest fraction of heads knocked out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--out", required=True, help="CSV to write")
    p.add_argument("--plot", metavar="FILE", help="also write the knockout figure (.html or .png)")
    _add_overwrite(p)
    p.set_defaults(func=cmd_knockout)

    p = sub.add_parser("plot", help="figures: heatmap, knockout, stability, similarity",
                       description="heatmap: a scores or mask JSON; knockout: a knockout CSV; stability: a "
                                   "scores JSON (computed) or CSV; similarity: a layer-similarity CSV.")
    p.add_argument("figure", choices=["heatmap", "knockout", "stability", "similarity"])
    p.add_argument("--in", dest="inp", required=True, help="input file")
    p.add_argument("--out", required=True, help="figure to write: .html (or .png with kaleido)")
    p.add_argument("--mask", help="heatmap: a mask JSON whose FA heads are marked")
    p.add_argument("--title", default=None)
    p.add_argument("--band", default="minmax", choices=["minmax", "std"], help="knockout: random-curve band")
    p.add_argument("--k", type=int, default=None, help="stability: top-K for the overlap (default 5%% of heads)")
    p.add_argument("--seed", type=int, default=0)
    _add_overwrite(p)
    p.set_defaults(func=cmd_plot)

    from headscope.evaluate.cli import add_parser as add_eval_parser

    add_eval_parser(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "fix your input", shown as one line with exit status 2."""
    from headscope.arch import UnsupportedModelError
    from headscope.plots import PngExportError

    errors: list[type[BaseException]] = [ValueError, LookupError, OSError, ImportError, UnsupportedModelError,
                                         PngExportError]
    try:
        from headscope.patching.engine import CleanFailureError, DegeneratePairError

        errors += [CleanFailureError, DegeneratePairError]
    except ImportError:
        pass
    return tuple(errors)


@contextlib.contextmanager
def _library_bars(show: bool):
    """--quiet: transformers' own progress bars (loading and writing weights) off for the command, as it was after."""
    if show:
        yield
        return
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "task", None) is None and args.command == "score":
        args.task = ["niah"]
    for name in ("n_samples", "batch_size", "context_length", "sender_k"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            return _fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if getattr(args, "sender_rounds", 0) < 0:
        return _fail(f"--sender-rounds must be >= 0, got {args.sender_rounds}")
    try:
        with _library_bars(not getattr(args, "quiet", False)):
            args.func(args)
        if getattr(args, "shard_mode", None):
            _stop_shard()
    except KeyboardInterrupt:
        return _fail("interrupted", code=130)
    except Exception as err:
        if args.debug:
            raise
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        if isinstance(err, _user_errors()):
            return _fail(msg)
        return _fail(f"{type(err).__name__}: {msg} (an internal error: rerun with --debug for the traceback and "
                     "please report it)", code=1)
    return 0


def _fail(msg: str, code: int = 2) -> int:
    print(f"headscope: error: {msg}", file=sys.stderr)
    return code
