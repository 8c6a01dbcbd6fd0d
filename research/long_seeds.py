"""Recipes past their teacher's context, over training seeds: each seed's rows of a suite with ``fidelity_long_text``
(``fidelity_long``, ``fidelity_long_reference``: run.py's ``<run>/<suite>/results.csv``), as one long table of
recipe x held-out source x window length: the student's perplexity (mean, spread, every seed); ``long_context_ratio``,
the same tokens read whole over read in chunks of the teacher's positions (at most 1: the student uses the longer
context instead of breaking on it); ``growth``, perplexity(L) / perplexity(base length) per seed (other windows of
the text at each length, so it mixes the text's difficulty in); the ratio to the teacher read in chunks of its
positions (``perplexity_ratio_chunked``), and where the teacher has the positions its ratio and top-1 agreement. A
line "mean over sources" averages each seed's sources first. With run.py's ``eval_rows.csv`` beside the suite, the
project's own-template NIAH per length joins (``template_accuracy``, hybrid and teacher), and the hybrid's from
``headscope eval --suite niah`` folders named ``niah_*`` in the run folder (a length past run.py's). Where the suite
also ran ``fidelity_long_niah`` (NIAH in phrasings and haystacks no training row has), its accuracy per length joins
as ``niah_accuracy``: the line "unseen niah" over every prompt, and one line per phrasing ("unseen niah: code").

    python -m research.long_seeds nope=runs/ref_cpu_long_s0,runs/ref_cpu_long_s1 \\
        rope=runs/ref_cpu_long_rope_s0,runs/ref_cpu_long_rope_s1 --base-length 2048 --out long_seeds.csv

``--template-only`` reads the own-template NIAH alone (runs trained without the suites, e.g. a retrieval-only
comparison at a new length): no perplexity lines.

``std`` is the sample standard deviation over seeds (ddof 1; NaN for one seed).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from research.fidelity_seeds import template_accuracy, write_csv

TEXT_METRICS = ("perplexity_student", "perplexity_student_chunked", "long_context_ratio", "perplexity_ratio_chunked",
                "perplexity_ratio", "top1_agreement")
MEAN_LINE = "mean over sources"
NIAH_LINE = "unseen niah"


def suite_file(run: Path) -> Path:
    """The results.csv with ``fidelity_long_text`` rows: a run folder's one ``*/results.csv`` that holds them, or
    that results.csv itself."""
    if run.is_dir():
        found = [p for p in sorted(run.glob("*/results.csv"))
                 if "fidelity_long_text" in set(pd.read_csv(p, usecols=["evaluation"]).evaluation)]
        if len(found) != 1:
            raise FileNotFoundError(f"{run}: {len(found)} suites with fidelity_long_text rows "
                                    f"({', '.join(p.parent.name for p in found) or 'none'}); give the results.csv")
        run = found[0]
    if not run.is_file():
        raise FileNotFoundError(f"{run}: no such file; give a run folder or a suite's results.csv")
    return run


def text_rows(suite: pd.DataFrame) -> pd.DataFrame:
    """The suite's ``fidelity_long_text`` rows (status ok)."""
    return suite[(suite.evaluation == "fidelity_long_text") & (suite.status == "ok")
                 & suite.metric.isin(TEXT_METRICS)]


def niah_lines(suite: pd.DataFrame) -> pd.DataFrame:
    """The suite's unseen NIAH (``fidelity_long_niah``, the student's accuracy) per length: over every prompt (each
    cell weighted by its prompts) and per phrasing. Empty where the suite has no such rows."""
    d = suite[(suite.evaluation == "fidelity_long_niah") & (suite.status == "ok")
              & (suite.metric == "accuracy_student")]
    if d.empty:
        return pd.DataFrame(columns=["line", "length", "metric", "value"])
    d = d.assign(hits=d.value * d.n)
    groups = [(NIAH_LINE, d)] + [(f"{NIAH_LINE}: {ph}", g) for ph, g in d.groupby("phrasing")]
    out = [pd.DataFrame({"line": name, "metric": "niah_accuracy",
                         "value": g.groupby("context_length").hits.sum() / g.groupby("context_length").n.sum()})
           .rename_axis("length").reset_index() for name, g in groups]
    return pd.concat(out, ignore_index=True)[["line", "length", "metric", "value"]]


def seed_lines(rows: pd.DataFrame, base_length: int) -> pd.DataFrame:
    """One seed: (line, length, metric, value), ``growth`` added per source, and the mean-over-sources line."""
    d = rows.groupby(["family", "context_length", "metric"]).value.mean().reset_index()
    d = d.rename(columns={"family": "line", "context_length": "length"})
    ppl = d[d.metric == "perplexity_student"].set_index(["line", "length"]).value
    base = ppl.xs(base_length, level="length") if base_length in ppl.index.get_level_values("length") else None
    if base is None:
        raise ValueError(f"no perplexity at the base length {base_length}; the suite's lengths are "
                         f"{sorted(set(ppl.index.get_level_values('length')))}: give one of them as --base-length")
    growth = (ppl / base.reindex(ppl.index.get_level_values("line")).to_numpy()).rename("value").reset_index()
    d = pd.concat([d, growth.assign(metric="growth")], ignore_index=True)
    mean = d.groupby(["length", "metric"]).value.mean().reset_index().assign(line=MEAN_LINE)
    return pd.concat([d, mean], ignore_index=True)


def template_lines(run: Path) -> pd.DataFrame:
    """The own-template NIAH accuracy per length: run.py's (``eval_rows.csv``, hybrid and teacher) and the hybrid's
    from ``headscope eval --suite niah`` folders in the run folder named ``niah_*`` (e.g. a length past run.py's)."""
    folder = run if run.is_dir() else run.parent.parent
    frames = []
    if (folder / "eval_rows.csv").is_file():
        frames.append(pd.read_csv(folder / "eval_rows.csv"))
    frames += [pd.read_csv(f).assign(model="hybrid") for f in sorted(folder.glob("niah_*/results.csv"))]
    if not frames:
        return pd.DataFrame(columns=["line", "length", "metric", "value"])
    t = template_accuracy(pd.concat(frames, ignore_index=True))
    return pd.DataFrame({"line": "template niah", "length": t.context_length, "metric": t.metric, "value": t.value})


def recipe_table(runs: list[Path], base_length: int, template_only: bool = False) -> pd.DataFrame:
    per_seed = []
    for i, run in enumerate(runs):
        template = template_lines(run)
        if template_only and template.empty:
            raise FileNotFoundError(f"{run}: no eval_rows.csv and no niah_*/results.csv (run.py's evaluation or "
                                    "headscope eval --suite niah --out RUN/niah_LENGTH)")
        if template_only:
            parts = [template]
        else:
            suite = pd.read_csv(suite_file(run))  # read once: its text and unseen-NIAH rows
            parts = [seed_lines(text_rows(suite), base_length), niah_lines(suite), template]
        lines = pd.concat(parts, ignore_index=True)
        per_seed.append(lines.assign(seed=i))
    d = pd.concat(per_seed, ignore_index=True)
    wide = d.pivot_table(index=["line", "length", "metric"], columns="seed", values="value", sort=False)
    out = pd.DataFrame({"mean": wide.mean(axis=1), "std": wide.std(axis=1, ddof=1), "seeds": wide.count(axis=1)})
    for s in wide.columns:
        out[f"seed_{s}"] = wide[s]
    return out.reset_index()


def parse_recipe(ap: argparse.ArgumentParser, spec: str) -> tuple[str, list[Path]]:
    name, sep, paths = spec.partition("=")
    if not sep or not name or not paths:
        ap.error(f"{spec!r}: give NAME=RUN[,RUN...] (a recipe's label and its seeds' run folders)")
    return name, [Path(p) for p in paths.split(",") if p]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("recipes", nargs="+", help="NAME=RUN[,RUN...]: a recipe's label and its seeds' run folders")
    ap.add_argument("--base-length", type=int, default=2048,
                    help="the window length growth is counted from (the teacher's positions; default 2048)")
    ap.add_argument("--out", type=Path, default=None, help="write the long table as CSV here")
    ap.add_argument("--template-only", action="store_true",
                    help="the own-template NIAH alone (runs without the fidelity_long suite)")
    a = ap.parse_args(argv)
    tables = []
    for spec in a.recipes:
        name, runs = parse_recipe(ap, spec)
        try:
            tables.append(recipe_table(runs, a.base_length, a.template_only).assign(recipe=name))
        except (FileNotFoundError, ValueError) as e:
            ap.error(f"{name}: {e}")
    table = pd.concat(tables, ignore_index=True)
    table = table[["recipe"] + [c for c in table.columns if c != "recipe"]]
    with pd.option_context("display.width", 200, "display.max_rows", 1000, "display.float_format", "{:.3f}".format):
        shown = table[table.metric.isin(["long_context_ratio", "perplexity_ratio_chunked", "growth",
                                         "perplexity_student", "template_accuracy", "niah_accuracy"])]
        print(shown.pivot_table(index=["metric", "line", "length"], columns="recipe", values="mean",
                                sort=False).to_string())
    if a.out is not None:
        write_csv(a.out, table)
    return table


if __name__ == "__main__":
    main()
