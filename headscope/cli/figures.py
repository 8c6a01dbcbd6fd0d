"""``headscope knockout`` (accuracy as the top heads are knocked out, against random heads) and ``headscope plot``
(heatmap, knockout, stability, similarity figures)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from headscope.cli import common
from headscope.cli.common import (MASK_KIND, SCORES_KIND, UsageError, check_csv, check_figure, fuse_scores,
                                  is_knockout_csv, load_scores, log, shape_text, task_kwargs)

def cmd_knockout(args: argparse.Namespace) -> None:
    from headscope.io import atomic_write
    from headscope.knockout import auc, knockout_curve

    check_csv(args.out, args)
    check_figure(args.plot, args)
    scores = load_scores(args.scores)
    fused = scores[0] if len(scores) == 1 else fuse_scores(scores, "max", "none", None, 0.1)
    real = [s.task for s in scores if s.kind != "fused"]
    task = args.task or (real[0] if len(set(real)) == 1 else None)
    if task is None:
        raise UsageError("pass --task: the scores cover several tasks, so the task to knock out on is ambiguous")
    model, tokenizer = common.load_model(args.model, args)
    df = knockout_curve(model, task, fused, tokenizer=tokenizer, max_fraction=args.max_fraction, kind=args.kind,
                        n_random=args.n_random, n_samples=args.n_samples, seed=args.seed, metric=args.metric,
                        batch_size=args.batch_size or 8, progress=not args.quiet, **task_kwargs(task, args))
    with atomic_write(args.out) as f:
        df.to_csv(f, index=False)
    a = auc(df)
    print(f"knockout on {task} ({args.kind}): mean accuracy top-k {a['top']:.3f}, random {a['random']:.3f}, "
          f"gap {a['gap']:.3f}")
    log(f"wrote {args.out}")
    if args.plot:
        from headscope.plots import knockout_plot, save

        log(f"wrote {save(knockout_plot(df, title=f'knockout on {task} ({args.kind})'), args.plot)}")


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
    if is_knockout_csv(src):
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

    check_figure(args.out, args, flag="--out")
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
                raise UsageError(f"--mask {args.mask} is for {shape_text(mask.n_layers, mask.n_heads)} but --in "
                                 f"{src} holds scores of {shape_text(inp.n_layers, inp.n_heads)}, so its FA heads "
                                 "would be marked outside the map: pass the mask selected from these scores (or "
                                 "the scores of the mask's model)")
            fig = plots.heatmap(torch.tensor(inp.scores), mask=mask,
                                n_kv_heads=inp.n_kv_heads, title=args.title or "mask scores, FA heads marked")
        else:
            scores = load_scores([str(src)])[0]
            if mask is not None and (mask.n_layers, mask.n_heads) != (scores.n_layers, scores.n_heads):
                raise UsageError(f"--mask {args.mask} is for {shape_text(mask.n_layers, mask.n_heads)} but --in "
                                 f"{src} holds scores of {shape_text(scores.n_layers, scores.n_heads)}, so its FA "
                                 "heads would be marked outside the map: pass the mask selected from these scores "
                                 "(or the scores of the mask's model)")
            fig = plots.heatmap(scores, mask=mask, title=args.title)
    elif args.figure == "knockout":
        fig = plots.knockout_plot(pd.read_csv(src), band=args.band, title=args.title)
    elif args.figure == "stability":
        if src.suffix == ".json":
            from headscope.stability import ranking_stability

            df = ranking_stability(load_scores([str(src)])[0], k=args.k, seed=args.seed)
        else:
            df = pd.read_csv(src)
        fig = plots.stability_plot(df, title=args.title)
    else:
        fig = plots.similarity_plot(_similarity_csv(src), title=args.title or
                                    "residual-stream cosine similarity between layers")
    log(f"wrote {plots.save(fig, args.out)}")


# ----------------------------------------------------------------------------- parser
