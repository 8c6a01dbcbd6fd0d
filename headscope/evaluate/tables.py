"""Headline tables of evaluation rows: ``summary(df)``, shared by ``headscope.evaluate.api`` (``compare``) and
``headscope.evaluate.output`` (summary.csv), which both import it from here."""
from __future__ import annotations

import pandas as pd

__all__ = ["summary", "SUMMARY_KEYS"]

# the row columns a headline number is grouped by (those a frame has)
SUMMARY_KEYS = ["evaluation", "metric", "context_length", "n_keys", "family", "size", "phrasing"]


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Headline numbers: mean value of every metric over depths and positions (per-position loss left out),
    by evaluation, length, keys, family, size and phrasing; ``n`` sums the prompts behind each."""
    d = df[(df.status == "ok") & (df.metric != "loss")].copy()
    keys = [k for k in SUMMARY_KEYS if k in d.columns]
    d[keys] = d[keys].astype(object).where(d[keys].notna(), "")
    out = d.groupby(keys, sort=False).agg(value=("value", "mean"), n=("n", "sum")).reset_index()
    return out
