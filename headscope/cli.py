"""The ``headscope`` command line: score heads, fuse and select them into a mask, knock them out, plot.

    headscope run --model default --task niah --task reasoning --ratio 7:1 --out mask.json
    headscope score --model default --task niah --n-samples 8 --context-length 1024 --out niah.json
    headscope select --scores niah.json reasoning.json --ratio 7:1 --model default --out mask.json
    headscope knockout --model default --scores niah.json --out curve.csv --plot curve.html
    headscope plot heatmap --in niah.json --out niah.html

User errors (bad arguments, missing files, unknown tasks, a model the data do not fit) print one
line ``headscope: error: ...`` and exit with status 2; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "build_parser"]


class UsageError(ValueError):
    """A bad command line that argparse itself cannot catch."""


# ----------------------------------------------------------------------------- helpers

def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
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
    from headscope.results import HeadScores

    out = []
    for p in paths:
        if not Path(p).exists():
            raise FileNotFoundError(f"scores file {p} does not exist")
        try:
            out.append(HeadScores.from_json(p))
        except (json.JSONDecodeError, KeyError) as err:
            raise UsageError(f"{p} is not a headscope scores file ({err})") from None
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


def _score_tasks(model, tokenizer, args: argparse.Namespace) -> list:
    from headscope.api import score

    out = []
    for task in args.task:
        t0 = time.time()
        s = score(model, task, tokenizer=tokenizer, n_samples=args.n_samples, seed=args.seed, metric=args.metric,
                  backend=args.backend, batch_size=args.batch_size, progress=not args.quiet,
                  on_clean_failure=args.on_clean_failure, **_task_kwargs(task, args))
        acc = s.clean_accuracy
        _log(f"scored {task}: {s.n_samples} samples in {time.time() - t0:.1f}s"
             + (f", clean accuracy {acc:.0%}" if acc is not None else "")
             + f"; top heads {', '.join(str(h) for h in s.top(5))}")
        out.append(s)
    return out


def _scores_paths(out: str, tasks: list[str]) -> list[Path]:
    p = Path(out)
    if len(tasks) == 1:
        return [p]
    return [p.with_name(f"{p.stem}.{t}{p.suffix or '.json'}") for t in tasks]


# ----------------------------------------------------------------------------- commands

def cmd_score(args: argparse.Namespace) -> None:
    model, tokenizer = _load_model(args.model, args)
    scores = _score_tasks(model, tokenizer, args)
    for s, path in zip(scores, _scores_paths(args.out, args.task)):
        path.parent.mkdir(parents=True, exist_ok=True)
        s.to_json(path)
        _log(f"wrote {path}")


def cmd_select(args: argparse.Namespace) -> None:
    fused = _fused(_load_scores(args.scores), args.combine, args.stability, args.weights, args.threshold)
    mask = _select(fused, args, _model_config(args.model))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    mask.to_json(args.out)
    print(_summary(mask))
    _log(f"wrote {args.out}")


def cmd_run(args: argparse.Namespace) -> None:
    t0 = time.time()
    model, tokenizer = _load_model(args.model, args)
    scores = _score_tasks(model, tokenizer, args)
    fused = _fused(scores, args.combine, args.stability, args.weights, args.threshold)
    mask = _select(fused, args, model)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    mask.settings.update({"model": args.model, "tasks": args.task, "n_samples": args.n_samples,
                          "context_length": args.context_length})
    mask.to_json(out)
    if args.save_scores:
        d = Path(args.save_scores)
        d.mkdir(parents=True, exist_ok=True)
        for s in scores:
            s.to_json(d / f"{s.task}.json")
        fused.to_json(d / "fused.json")
        _log(f"wrote scores to {d}/")
    if args.plot:
        from headscope.plots import heatmap, save

        _log(f"wrote {save(heatmap(fused, mask=mask, title='fused head scores, FA heads marked'), args.plot)}")
    print(_summary(mask))
    _log(f"wrote {out} in {time.time() - t0:.1f}s")


def cmd_knockout(args: argparse.Namespace) -> None:
    from headscope.knockout import auc, knockout_curve

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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    a = auc(df)
    print(f"knockout on {task} ({args.kind}): mean accuracy top-k {a['top']:.3f}, random {a['random']:.3f}, "
          f"gap {a['gap']:.3f}")
    _log(f"wrote {args.out}")
    if args.plot:
        from headscope.plots import knockout_plot, save

        _log(f"wrote {save(knockout_plot(df, title=f'knockout on {task} ({args.kind})'), args.plot)}")


def cmd_plot(args: argparse.Namespace) -> None:
    import pandas as pd
    import torch

    from headscope import plots

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
            mask = mask or HeadMask.from_dict(data)
            if mask.scores is None:
                raise UsageError(f"{src} is a head mask without scores; plot its scores file instead")
            fig = plots.heatmap(torch.tensor(mask.scores), mask=mask,
                                n_kv_heads=mask.n_kv_heads, title=args.title or "mask scores, FA heads marked")
        else:
            fig = plots.heatmap(_load_scores([str(src)])[0], mask=mask, title=args.title)
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
        fig = plots.similarity_plot(pd.read_csv(src, index_col=0), title=args.title or
                                    "residual-stream cosine similarity between layers")
    _log(f"wrote {plots.save(fig, args.out)}")


# ----------------------------------------------------------------------------- parser

def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (the shipped reference model, the default) or a local Hugging Face folder")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _add_tasks(p: argparse.ArgumentParser, multiple: bool = True) -> None:
    if multiple:
        p.add_argument("--task", action="append", default=None,
                       help="task to score (repeatable): niah, niah_multikey, arithmetic, binding, comparison, "
                            "two_hop, reasoning (default: niah)")
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


def _add_selection(p: argparse.ArgumentParser) -> None:
    from headscope.fusion import COMBINE_RULES, DEFAULT_THRESHOLD, STABILITY_METHODS
    from headscope.selection import STRATEGIES

    g = p.add_mutually_exclusive_group()
    g.add_argument("--k", type=int, help="number of full-attention heads")
    g.add_argument("--fraction", type=float, help="fraction of heads kept as full attention, in (0, 1]")
    g.add_argument("--ratio", help="LA:FA ratio, e.g. 7:1 (the default when no budget is given)")
    p.add_argument("--strategy", default="global_per_layer_min", choices=STRATEGIES,
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
                       description="Score heads on each task, fuse the tasks, select FA heads, write the mask.")
    _add_model(p)
    _add_tasks(p)
    _add_score_opts(p)
    _add_selection(p)
    p.add_argument("--out", default="mask.json", help="head-mask JSON to write (default mask.json)")
    p.add_argument("--save-scores", metavar="DIR", help="also write each task's and the fused scores here")
    p.add_argument("--plot", metavar="FILE", help="also write a heatmap of the fused scores (.html or .png)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("score", help="causal receiver scores of every head on one or more tasks",
                       description="Score every head by activation patching; one JSON file per task.")
    _add_model(p)
    _add_tasks(p)
    _add_score_opts(p)
    p.add_argument("--out", required=True,
                   help="scores JSON; with several tasks, OUT's stem gets the task name (scores.niah.json, ...)")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("select", help="fuse score files and select FA heads into a mask",
                       description="Fuse score files (one per task; a task's receiver and sender files are "
                                   "combined) and select the full-attention heads.")
    p.add_argument("--scores", nargs="+", required=True, help="scores JSON files (from `headscope score`)")
    _add_selection(p)
    p.add_argument("--seed", dest="tie_seed", type=int, default=None, help="random tie-breaking among equal scores")
    p.add_argument("--model", default=None, help="'default' or a local folder: record its shape and fingerprint")
    p.add_argument("--out", required=True, help="head-mask JSON to write")
    p.set_defaults(func=cmd_select)

    p = sub.add_parser("knockout", help="accuracy as the top-k heads (vs random heads) are knocked out",
                       description="Knock out the top-k heads by score and as many random heads; write a CSV.")
    _add_model(p)
    p.add_argument("--scores", nargs="+", required=True, help="scores JSON file(s); several are fused")
    p.add_argument("--task", default=None, help="task to evaluate on (default: the scores' task)")
    _add_tasks(p, multiple=False)
    p.add_argument("--kind", default="patch", choices=["patch", "mean", "zero"],
                   help="ablation: patch = the head's activation on the corrupted prompt (default, the paper's), "
                        "mean, zero")
    p.add_argument("--n-random", type=int, default=5, help="random head sets per k (default 5)")
    p.add_argument("--max-fraction", type=float, default=0.1, help="largest fraction of heads knocked out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--out", required=True, help="CSV to write")
    p.add_argument("--plot", metavar="FILE", help="also write the knockout figure (.html or .png)")
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
    p.set_defaults(func=cmd_plot)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "task", None) is None and args.command in ("run", "score"):
        args.task = ["niah"]
    for name in ("n_samples", "batch_size", "context_length"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            return _fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    try:
        args.func(args)
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
