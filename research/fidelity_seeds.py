"""A recipe's fidelity over training seeds: the fidelity suite's rows of each seed's run (``fidelity_rows.csv``, or
a run folder's ``fidelity/results.csv``, or another suite's, e.g. ``fidelity_reference/results.csv``) as one table
of means and spreads per line (held-out source, chat, NIAH length) and metric, beside the targets a hybrid that
stays its teacher has to reach and the gap to each. Where the
seed's folder also has run.py's ``eval_rows.csv`` and ``results.json``, the project's own NIAH template
(``template niah @L``: ``template_accuracy`` and the teacher's) and the stages' GPU minutes (``training``) join it.

    python -m research.fidelity_seeds \\
        docs/results/2026-12-03_smollm2_broad_hybrid_fidelity_seed0/fidelity_rows.csv \\
        docs/results/2026-12-03_smollm2_broad_hybrid_fidelity_seed1/fidelity_rows.csv --seeds 0,1 --out seeds.csv

A single rows file with a ``train_seed`` column (several seeds' rows in one file) gives its seeds by that column.
``std`` is the sample standard deviation over the seeds (ddof 1; NaN for one seed). ``gap`` is how far the mean is
on the wrong side of its target (0 when met); ``met_every_seed`` whether each seed meets it on its own, of the seeds
that measured the line (``seeds`` counts them).

``--base`` compares a recipe with another (e.g. a one-setting variant with the recipe it changes): the base's seeds
(files or folders as above) add ``base_mean``, ``base_std``, ``change`` (mean - base_mean) and ``outside_base``:
true where every seed of this recipe lies beyond every seed of the base, on the same side (false where the two
overlap; empty where either lacks the line).

    python -m research.fidelity_seeds docs/results/2026-12-04_smollm2_broad_align_long_fidelity_seed0 \
        --base docs/results/2026-12-03_smollm2_broad_hybrid_fidelity_seed0 \
               docs/results/2026-12-03_smollm2_broad_hybrid_fidelity_seed1
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

# metric -> (direction, target): what the hybrid has to reach on data no training row used. Text metrics apply to
# every held-out source line; accuracy_difference (hybrid - teacher) to every NIAH length.
TARGETS = {
    "perplexity_ratio": ("<=", 1.15),
    "top1_agreement": (">=", 0.80),
    "continuation_agreement": (">=", 0.50),
    "chat_nll_ratio": ("<=", 1.20),
    "accuracy_difference": (">=", -0.05),
    "template_accuracy": (">=", 0.95),
    "gpu_minutes": ("<=", 30.0),
}
SHOWN = ("perplexity_ratio", "kl_to_teacher", "top1_agreement", "continuation_agreement", "chat_nll_ratio",
         "chat_nll_ratio_no_loops", "chat_repeated_4grams_student", "chat_repeated_4grams_teacher",
         "accuracy_student", "accuracy_teacher",
         "accuracy_difference", "template_accuracy", "template_accuracy_teacher", "gpu_minutes")


def read_rows(path: Path) -> pd.DataFrame:
    """A seed's fidelity rows: a ``fidelity_rows.csv`` or ``results.csv`` file, or a folder holding one. A folder
    whose suite was cut short (a study row or run.py folder with ``fidelity_parts/`` but no ``fidelity/``) gives the
    evaluations finished so far, each part's rows once, like ``research.studies.runner.suite_rows``."""
    if path.is_dir():
        # in this order: a results folder's rows, the fidelity suite's, its finished parts, else the one other
        # suite's (fidelity_reference)
        found = [path / n for n in ("fidelity_rows.csv", "fidelity/results.csv") if (path / n).is_file()]
        parts = sorted((path / "fidelity_parts").glob("*/results.csv"))
        if not found and parts:
            return pd.concat([pd.read_csv(f) for f in parts], ignore_index=True)
        found = found[:1] or sorted(path.glob("fidelity_*/results.csv"))
        if len(found) != 1:
            what = f"{len(found)} suites' rows ({', '.join(str(f.parent.name) for f in found)})" if found else \
                "no fidelity_rows.csv or fidelity*/results.csv"
            raise FileNotFoundError(f"{path}: {what}; give the rows of one fidelity suite (a results folder, "
                                    "run.py's --out folder, or the results.csv itself)")
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; give a fidelity_rows.csv or a run folder")
    return pd.read_csv(path)


def template_accuracy(rows: pd.DataFrame) -> pd.DataFrame:
    """The own-template NIAH accuracy per model and length from evaluation rows with a ``model`` column (run.py's
    ``eval_rows.csv``): (context_length, metric, value), ``template_accuracy`` for the hybrid and
    ``template_accuracy_<model>`` for the others."""
    d = rows[(rows.status == "ok") & (rows.evaluation == "niah") & (rows.metric == "accuracy")]
    out = d.groupby(["model", "context_length"]).value.mean().reset_index()
    metric = ["template_accuracy" if m == "hybrid" else f"template_accuracy_{m}" for m in out.model]
    return pd.DataFrame({"context_length": out.context_length, "metric": metric, "value": out.value})


def write_csv(out: Path, table: pd.DataFrame) -> None:
    """``table`` as CSV at ``out`` (written whole or not at all), and a line on stderr saying so."""
    from headscope.io import write_text

    write_text(out, table.to_csv(index=False, float_format="%.6g"))
    print(f"wrote {out}", file=sys.stderr)


def extra_rows(path: Path) -> pd.DataFrame:
    """(source, metric, value) rows from run.py's files beside a seed's fidelity rows (its folder, or the run folder
    above ``fidelity/``): the template NIAH accuracy per length, hybrid and teacher; the stages' GPU minutes."""
    folder = path if path.is_dir() else path.parent
    folders = [folder, folder.parent] if folder.name == "fidelity" else [folder]
    out = []
    for f in folders:
        if (f / "eval_rows.csv").is_file():
            t = template_accuracy(pd.read_csv(f / "eval_rows.csv"))
            out += [dict(source=f"template niah @{int(L)}", metric=m, value=v)
                    for L, m, v in zip(t.context_length, t.metric, t.value)]
        if (f / "results.json").is_file():
            minutes = (json.loads((f / "results.json").read_text()).get("train") or {}).get("minutes_total")
            if minutes is not None:
                out.append(dict(source="training", metric="gpu_minutes", value=float(minutes)))
        if out:
            break
    return pd.DataFrame(out, columns=["source", "metric", "value"])


def seed_table(frames: dict[int, pd.DataFrame], extras: dict[int, pd.DataFrame] | None = None) -> pd.DataFrame:
    """Long table: a line per (line, metric) with the mean, std and seeds' values, the target and the gap.
    ``extras``: per seed, more (source, metric, value) rows (``extra_rows``)."""
    from headscope.evaluate.tables import fidelity_table

    per_seed = []
    for seed, df in frames.items():
        t = fidelity_table(df.drop(columns=[c for c in ("model", "seed") if c in df.columns]))
        long = t.drop(columns="kind").reset_index().melt(id_vars="source", var_name="metric").dropna()
        if extras is not None and seed in extras and len(extras[seed]):
            long = pd.concat([long, extras[seed]], ignore_index=True)
        per_seed.append(long.assign(seed=seed))
    d = pd.concat(per_seed)
    d = d[d.metric.isin(SHOWN)]
    wide = d.pivot_table(index=["source", "metric"], columns="seed", values="value", sort=False)
    out = pd.DataFrame({"mean": wide.mean(axis=1), "std": wide.std(axis=1, ddof=1), "seeds": wide.count(axis=1)})
    for seed in wide.columns:
        out[f"seed_{seed}"] = wide[seed]
    direction = out.index.get_level_values("metric").map(lambda m: TARGETS.get(m, ("", float("nan")))[0])
    target = out.index.get_level_values("metric").map(lambda m: TARGETS.get(m, ("", float("nan")))[1])
    out["target"] = [f"{d} {t:g}" if d else "" for d, t in zip(direction, target)]
    sign = pd.Series([1.0 if d == "<=" else -1.0 if d == ">=" else float("nan") for d in direction], index=out.index)
    tgt = pd.Series(list(target), index=out.index, dtype=float)
    out["gap"] = ((out["mean"] - tgt) * sign).clip(lower=0.0)
    seeds_ok = wide.sub(tgt, axis=0).mul(sign, axis=0).le(0) | wide.isna()  # a seed without the line does not count
    out["met_every_seed"] = seeds_ok.all(axis=1).where(sign.notna())
    return out.reset_index().rename(columns={"source": "line"})


def compare(table: pd.DataFrame, base: pd.DataFrame) -> pd.DataFrame:
    """``table`` (``seed_table``) with the base recipe's mean and spread beside each line, the change of the mean and
    whether every seed of ``table`` lies beyond every seed of ``base`` on one side."""
    key = ["line", "metric"]
    cols = lambda t: [c for c in t.columns if c.startswith("seed_")]  # noqa: E731
    b = base.set_index(key)
    t = table.set_index(key)
    out = t.copy()
    out["base_mean"] = b["mean"].reindex(t.index)
    out["base_std"] = b["std"].reindex(t.index)
    out["change"] = out["mean"] - out["base_mean"]
    lo_t, hi_t = t[cols(t)].min(axis=1), t[cols(t)].max(axis=1)
    lo_b, hi_b = b[cols(b)].min(axis=1).reindex(t.index), b[cols(b)].max(axis=1).reindex(t.index)
    outside = (lo_t > hi_b) | (hi_t < lo_b)
    out["outside_base"] = outside.where(out["base_mean"].notna() & out["mean"].notna())
    return out.reset_index()


def load_seeds(ap: argparse.ArgumentParser, paths: list[Path], seeds_arg: str | None, what: str):
    """Per seed, the suite's rows and run.py's extra rows, from files or folders (or one file with train_seed)."""
    seeds = list(range(len(paths))) if seeds_arg is None else [int(s) for s in seeds_arg.split(",") if s.strip()]
    if len(seeds) != len(paths) or len(set(seeds)) != len(seeds):
        ap.error(f"--seeds needs {len(paths)} distinct values, one per rows file; got {seeds_arg!r}")
    try:
        loaded = [read_rows(p) for p in paths]
    except FileNotFoundError as e:
        ap.error(f"{what}: {e}")
    frames, extras = {}, {}
    for seed, path, df in zip(seeds, paths, loaded):
        if "train_seed" in df.columns:  # one file holding several seeds' rows (its train_seed column names them)
            if seeds_arg is not None or len(paths) > 1:
                ap.error(f"{path} holds the rows of several seeds (train_seed column): give it alone, without --seeds")
            frames = {int(s): g for s, g in df.groupby("train_seed")}
        else:
            frames[seed], extras[seed] = df, extra_rows(path)
    return frames, extras


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("rows", nargs="+", type=Path, help="each seed's fidelity_rows.csv (or its run folder)")
    ap.add_argument("--seeds", default=None, help="comma list, one per rows file (default 0, 1, ...)")
    ap.add_argument("--out", type=Path, default=None, help="write the table as CSV here")
    ap.add_argument("--base", nargs="+", type=Path, default=None,
                    help="another recipe's seeds (files or folders): its mean and spread beside each line")
    a = ap.parse_args(argv)
    frames, extras = load_seeds(ap, a.rows, a.seeds, "rows")
    table = seed_table(frames, extras)
    if a.base is not None:
        table = compare(table, seed_table(*load_seeds(ap, a.base, None, "--base")))
    with pd.option_context("display.width", 200, "display.max_rows", 500, "display.float_format", "{:.3f}".format):
        print(table.to_string(index=False))
    if a.out is not None:
        write_csv(a.out, table)
    return table


if __name__ == "__main__":
    main()
