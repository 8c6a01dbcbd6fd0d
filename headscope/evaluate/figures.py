"""Plotly figures of evaluation results: the NIAH depth x length heatmap, a line per length, multi-key NIAH,
per-position loss, and the side-by-side comparison of several models."""
from __future__ import annotations

from typing import Any

import pandas as pd

__all__ = ["niah_heatmap", "niah_lines", "multikey_plot", "loss_curves", "compare_plot", "figures_for"]


def _go():
    from headscope.plots import _go as go

    return go()


def _ok(df: pd.DataFrame, evaluation: str, metric: str) -> pd.DataFrame:
    return df[(df.evaluation == evaluation) & (df.metric == metric) & (df.status == "ok")]


def niah_heatmap(df: pd.DataFrame, metric: str = "accuracy", title: str | None = None):
    """Needle depth (y, 0 = start of the haystack at the top) x context length (x) heatmap of accuracy."""
    go = _go()
    d = _ok(df, "niah", metric)
    if d.empty:
        raise ValueError(f"niah_heatmap: no 'niah' rows with metric {metric!r} and status 'ok' in the results")
    grid = d.pivot_table(index="depth", columns="context_length", values="value", aggfunc="mean")  # [depth, length]
    grid = grid.sort_index().reindex(sorted(grid.columns), axis=1)
    x = [str(int(c)) for c in grid.columns]
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=x, y=[f"{v:.2f}" for v in grid.index], zmin=0, zmax=1,
                               colorscale="RdYlGn", colorbar={"title": "accuracy"},
                               hovertemplate="length %{x}<br>depth %{y}<br>accuracy %{z:.2f}<extra></extra>"))
    fig.update_layout(title=title or f"NIAH {metric.replace('_', ' ')} by context length and needle depth",
                      xaxis_title="context length (tokens)", yaxis_title="needle depth (fraction of the haystack)",
                      yaxis={"autorange": "reversed", "type": "category"}, xaxis={"type": "category"})
    return fig


def niah_lines(df: pd.DataFrame, metric: str = "accuracy", title: str | None = None):
    """Accuracy by needle depth, one line per context length."""
    go = _go()
    d = _ok(df, "niah", metric)
    fig = go.Figure()
    for L, g in d.groupby("context_length"):
        g = g.groupby("depth")["value"].mean().sort_index()
        fig.add_trace(go.Scatter(x=g.index, y=g.values, mode="lines+markers", name=f"{int(L)} tokens"))
    fig.update_layout(title=title or "NIAH accuracy by needle depth, one line per context length",
                      xaxis_title="needle depth", yaxis_title=metric.replace("_", " "), yaxis_range=[-0.02, 1.02])
    return fig


def multikey_plot(df: pd.DataFrame, metric: str = "accuracy", title: str | None = None):
    go = _go()
    d = _ok(df, "niah_multikey", metric)
    fig = go.Figure()
    for k, g in d.groupby("n_keys"):
        g = g.sort_values("context_length")
        fig.add_trace(go.Scatter(x=g.context_length, y=g.value, mode="lines+markers", name=f"{int(k)} keys"))
    fig.update_layout(title=title or "multi-key NIAH accuracy by context length", xaxis_title="context length (tokens)",
                      yaxis_title=metric.replace("_", " "), xaxis_type="log", yaxis_range=[-0.02, 1.02])
    return fig


def loss_curves(df: pd.DataFrame, title: str | None = None):
    """Mean next-token loss by position, one line per window length."""
    go = _go()
    d = _ok(df, "perplexity", "loss")
    fig = go.Figure()
    for L, g in d.groupby("context_length"):
        g = g.sort_values("position")
        fig.add_trace(go.Scatter(x=g.position, y=g.value, mode="lines", name=f"{int(L)}-token windows"))
    fig.update_layout(title=title or "held-out loss by position", xaxis_title="position (tokens)",
                      yaxis_title="mean next-token loss (nats)", xaxis_type="log")
    return fig


def figures_for(df: pd.DataFrame) -> dict[str, Any]:
    """The figures the results allow, by file stem."""
    out: dict[str, Any] = {}
    if not _ok(df, "niah", "accuracy").empty:
        out["niah_heatmap"] = niah_heatmap(df)
        out["niah_lines"] = niah_lines(df)
    elif not _ok(df, "niah", "accuracy_teacher_forced").empty:
        out["niah_heatmap"] = niah_heatmap(df, "accuracy_teacher_forced")
    if not _ok(df, "niah_multikey", "accuracy").empty:
        out["multikey"] = multikey_plot(df)
    if not _ok(df, "perplexity", "loss").empty:
        out["loss_by_position"] = loss_curves(df)
    return out


def compare_plot(table: pd.DataFrame, title: str | None = None):
    """One figure for several models: headline metrics (columns: models) as grouped bars."""
    go = _go()
    labels = [" ".join(str(v) for v in (idx if isinstance(idx, tuple) else (idx,)) if str(v) not in ("", "nan"))
              for idx in table.index]
    fig = go.Figure([go.Bar(name=str(m), x=labels, y=table[m].to_numpy()) for m in table.columns])
    fig.update_layout(barmode="group", title=title or "evaluation side by side", yaxis_title="value",
                      xaxis_tickangle=-40)
    return fig
