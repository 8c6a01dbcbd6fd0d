"""Several recipes' (or a study's rows') fidelity side by side: for each, its seeds' fidelity rows (files or folders,
as ``research.fidelity_seeds`` reads them), and one table with a line per (held-out line, metric) and a column per
recipe, "mean +- std" over its seeds (the mean alone for one seed), beside the target.

    python -m research.fidelity_recipes \\
        causal=docs/results/2026-12-03_smollm2_broad_hybrid_fidelity_seed0,docs/results/2026-12-03_smollm2_broad_hybrid_fidelity_seed1 \\
        random=docs/results/2026-12-06_smollm2_broad_study_random_kv_h100 --out table.csv --markdown table.md

A recipe is ``NAME=PATH[,PATH...]``, one path per training seed (a study row's ``variants/NAME/seedS`` folder works
too). ``--metrics`` picks the metrics shown (default: the headline ones: perplexity ratio, KL, top-1 and
continuation agreement per held-out source, the chat NLL ratio, NIAH accuracy of student and teacher per length).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from research.fidelity_seeds import TARGETS, extra_rows, read_rows, seed_table, write_csv

HEADLINE = ("perplexity_ratio", "kl_to_teacher", "top1_agreement", "continuation_agreement", "chat_nll_ratio",
            "accuracy_student", "accuracy_teacher")


def parse_recipe(spec: str) -> tuple[str, list[Path]]:
    name, sep, paths = spec.partition("=")
    if not sep or not name.strip() or not paths.strip():
        raise ValueError(f"recipe {spec!r}: give NAME=PATH[,PATH...] (one path per training seed)")
    return name.strip(), [Path(p) for p in paths.split(",") if p.strip()]


def recipe_table(recipes: dict[str, list[Path]], metrics: tuple[str, ...] = HEADLINE) -> pd.DataFrame:
    """A line per (line, metric) of ``metrics``, in the first recipe's order; per recipe ``NAME`` ("mean +- std"
    text), ``NAME_mean``, ``NAME_std`` and ``NAME_seeds``; ``target``."""
    out = None
    for name, paths in recipes.items():
        frames = {i: read_rows(p) for i, p in enumerate(paths)}
        t = seed_table(frames, {i: extra_rows(p) for i, p in enumerate(paths)})
        t = t[t.metric.isin(metrics)].set_index(["line", "metric"])
        cols = pd.DataFrame({f"{name}_mean": t["mean"], f"{name}_std": t["std"], f"{name}_seeds": t["seeds"]})
        cols[name] = [f"{m:.3f}" if pd.isna(s) else f"{m:.3f} +- {s:.3f}" for m, s in zip(t["mean"], t["std"])]
        if out is None:
            out = cols.assign(target=t["target"])
        else:
            out = out.join(cols, how="outer", sort=False)
            out["target"] = out["target"].fillna(t["target"].reindex(out.index))
    order = {m: i for i, m in enumerate(metrics)}
    out = out.reset_index()
    out = out.sort_values("metric", key=lambda s: s.map(order), kind="stable")
    return out.reset_index(drop=True)


def markdown(table: pd.DataFrame, names: list[str]) -> str:
    """The table's text columns as markdown ("-" where a recipe lacks the line)."""
    from research.studies.metrics import to_markdown

    shown = table[["line", "metric"] + names + ["target"]].copy()
    shown[names] = shown[names].fillna("-")
    shown["target"] = shown["target"].fillna("")
    return to_markdown(shown) + "\n"


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("recipes", nargs="+", help="NAME=PATH[,PATH...], one path per training seed")
    ap.add_argument("--metrics", default=",".join(HEADLINE), help="comma list of the metrics shown")
    ap.add_argument("--out", type=Path, default=None, help="write the table as CSV here")
    ap.add_argument("--markdown", type=Path, default=None, help="write it as a markdown table here")
    a = ap.parse_args(argv)
    try:
        recipes = dict(parse_recipe(s) for s in a.recipes)
        if len(recipes) != len(a.recipes):
            raise ValueError("two recipes have the same name: give each its own")
        table = recipe_table(recipes, tuple(m for m in a.metrics.split(",") if m))
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    names = list(recipes)
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print(table[["line", "metric"] + names + ["target"]].to_string(index=False))
    if a.out is not None:
        write_csv(a.out, table)
    if a.markdown is not None:
        from headscope.io import write_text

        write_text(a.markdown, markdown(table, names))
        print(f"wrote {a.markdown}", file=sys.stderr)
    return table


if __name__ == "__main__":
    main()
