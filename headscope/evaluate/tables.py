"""Headline tables of evaluation rows: ``summary(df)``, shared by ``headscope.evaluate.api`` (``compare``) and
``headscope.evaluate.output`` (summary.csv), which both import it from here; ``fidelity_table(df)``, the fidelity
suite's rows as one line per held-out source and one per NIAH length."""
from __future__ import annotations

import pandas as pd

__all__ = ["summary", "fidelity_table", "SUMMARY_KEYS", "FIDELITY_SOURCE_METRICS"]

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


# the fidelity suite's per-source metrics, in the order a fidelity table shows them
FIDELITY_SOURCE_METRICS = ("perplexity_ratio", "perplexity_student", "perplexity_teacher", "kl_to_teacher",
                           "top1_agreement", "continuation_agreement")


def fidelity_table(df: pd.DataFrame) -> pd.DataFrame:
    """The fidelity suite's rows (``headscope.evaluate(student, suite="fidelity", teacher=...)``) as one table:
    a line per held-out text source (``perplexity_ratio`` ... ``continuation_agreement`` as columns), a line for the
    chat instructions (``chat_nll_ratio`` and the answers' NLLs), and a line per NIAH length (``accuracy_student``,
    ``accuracy_teacher`` and their difference, over the unseen phrasings and haystacks). Columns a frame lacks are
    left out; a frame with several ``model`` or ``seed`` values gets them as leading index levels."""
    d = df[df.status == "ok"] if "status" in df.columns else df
    extra = [k for k in ("model", "seed") if k in d.columns and d[k].nunique(dropna=False) > 1]
    if d.empty:
        raise ValueError("fidelity_table: no rows with status 'ok'; give the rows of the fidelity suite")

    def by_source(frame: pd.DataFrame) -> pd.DataFrame:  # metrics as columns, a line per (model, seed,) source
        return frame.pivot_table(index=extra + ["source"], columns="metric", values="value", aggfunc="mean",
                                 sort=False)

    d = d.rename(columns={"family": "source"})
    parts = []
    text = d[d.evaluation.isin(["fidelity_text", "fidelity_continuation"])
             & d.metric.isin(FIDELITY_SOURCE_METRICS)]
    if len(text):
        t = by_source(text)
        parts.append(t[[m for m in FIDELITY_SOURCE_METRICS if m in t.columns]].assign(kind="text"))
    chat = d[(d.evaluation == "fidelity_chat") & d.metric.str.startswith("chat_")]
    if len(chat):
        parts.append(by_source(chat).assign(kind="chat"))
    niah = d[(d.evaluation == "fidelity_niah") & d.metric.isin(["accuracy_student", "accuracy_teacher"])]
    if len(niah):
        n = by_source(niah.assign(source="niah @" + niah.context_length.astype(int).astype(str)))
        n["accuracy_difference"] = n["accuracy_student"] - n["accuracy_teacher"]
        parts.append(n.assign(kind="niah"))
    if not parts:
        raise ValueError("fidelity_table: no fidelity rows (evaluation fidelity_text, fidelity_continuation, "
                         "fidelity_chat or fidelity_niah); give the rows of the fidelity suite")
    out = pd.concat(parts, sort=False)
    out.columns.name = None
    return out[["kind"] + [c for c in out.columns if c != "kind"]]
