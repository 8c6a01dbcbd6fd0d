"""Plotly figures of head scores, knockout curves, ranking stability and layer similarity.

    fig = heatmap(scores, mask=mask)      # layer x head; hover: layer, head, score, rank, KV group
    save(fig, "scores.html")              # HTML always; "x.png" also writes x.html, then the PNG via kaleido

plotly is imported inside the functions, so ``import headscope`` does not need it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from headscope.results import HeadScores

__all__ = ["heatmap", "knockout_plot", "stability_plot", "similarity_plot", "save", "check_figure_path",
           "check_png_export", "FIGURE_SUFFIXES", "PNG_HINT", "PngExportError"]

PNG_HINT = "pip install kaleido  (and a Chrome/Chromium for it, e.g. apt-get install chromium)"


class PngExportError(RuntimeError):
    """A PNG could not be written (kaleido or its browser missing); the HTML figure was written."""


def _go():
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise ImportError("headscope.plots needs plotly: pip install plotly") from None
    return go


def heatmap(scores: HeadScores | torch.Tensor, title: str | None = None, n_kv_heads: int | None = None,
            mask: Any = None, value: str = "scores", colorscale: str = "Viridis"):
    """Layer (y) x head (x) heatmap of ``scores`` (HeadScores: its ``.scores`` or ``.raw``; or a [L, H] map).

    Hover shows layer, head, score, rank (1 = best) and KV group. ``mask`` (a HeadMask) marks its
    full-attention heads with open squares.
    """
    go = _go()
    if value not in ("scores", "raw"):
        raise ValueError(f"heatmap: value={value!r} must be 'scores' or 'raw'")
    if isinstance(scores, HeadScores):
        s = getattr(scores, value).double().numpy()  # [L, H]
        n_kv_heads = n_kv_heads or scores.n_kv_heads
        title = title or f"{scores.task} ({scores.kind}) head scores"
    else:
        s = np.asarray(torch.as_tensor(scores, dtype=torch.float64))  # [L, H]
        title = title or "head scores"
    if s.ndim != 2:
        raise ValueError(f"heatmap: scores must be [layers, heads], got shape {s.shape}")
    L, H = s.shape
    group = H // n_kv_heads if n_kv_heads and H % n_kv_heads == 0 else 1
    flat = s.ravel()
    order = np.lexsort((np.arange(flat.size), -flat))
    rank = np.empty(flat.size, dtype=np.int64)
    rank[order] = np.arange(1, flat.size + 1)
    layer, head = np.meshgrid(np.arange(L), np.arange(H), indexing="ij")  # [L, H] each
    custom = np.stack([layer, head, s, rank.reshape(L, H), head // group], axis=-1)  # [L, H, 5]
    fig = go.Figure(go.Heatmap(
        z=s, x=list(range(H)), y=list(range(L)), customdata=custom, colorscale=colorscale, name="score",
        colorbar={"title": "score"},
        hovertemplate=("layer %{customdata[0]:d}, head %{customdata[1]:d}<br>score %{customdata[2]:.4f}<br>"
                       "rank %{customdata[3]:d} of " + str(L * H) + "<br>KV group %{customdata[4]:d}<extra></extra>")))
    if mask is not None:
        ml, mh = getattr(mask, "n_layers", None), getattr(mask, "n_heads", None)
        if ml is not None and (ml, mh) != (L, H):
            raise ValueError(f"heatmap: the mask is for {ml} layers x {mh} heads but the scores are {L} layers x "
                             f"{H} heads, so its FA heads would be marked outside the map: pass the mask selected "
                             "from these scores (or the scores of the mask's model)")
        fa = list(mask.fa_heads)
        fig.add_trace(go.Scatter(x=[h.head for h in fa], y=[h.layer for h in fa], mode="markers", name="FA heads",
                                 marker={"symbol": "square-open", "size": 12, "color": "red", "line": {"width": 2}},
                                 hovertemplate="FA: layer %{y}, head %{x}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="head", yaxis_title="layer", template="plotly_white")
    fig.update_yaxes(autorange="reversed", dtick=1 if L <= 40 else None)
    fig.update_xaxes(dtick=1 if H <= 40 else None)
    return fig


def _band(go, x, lo, hi, name: str, color: str):
    """A filled band between lo and hi (one closed polygon trace)."""
    return go.Scatter(x=list(x) + list(x)[::-1], y=list(hi) + list(lo)[::-1], fill="toself", mode="lines",
                      line={"width": 0}, fillcolor=color, name=name, hoverinfo="skip")


def knockout_plot(df, y: str = "accuracy", band: str = "minmax", title: str | None = None):
    """Accuracy (or ``y="metric"``) vs fraction of heads knocked out: the top-k curve, the mean of the
    random curves, and a band over the random seeds (``band``: "minmax" or "std")."""
    go = _go()
    if band not in ("minmax", "std"):
        raise ValueError(f"knockout_plot: band={band!r} must be 'minmax' or 'std'")
    need = {"k", "fraction", "selection", y}
    if not need <= set(df.columns):
        raise ValueError(f"knockout_plot: df needs columns {sorted(need)}; pass knockout_curve()'s output")
    fig = go.Figure()
    rnd = df[df.selection == "random"]
    if len(rnd):
        g = rnd.groupby("fraction")[y]
        mean, x = g.mean(), g.mean().index.to_numpy() * 100
        if band == "minmax":
            lo, hi = g.min().to_numpy(), g.max().to_numpy()
        else:
            sd = g.std(ddof=0).fillna(0.0).to_numpy()
            lo, hi = mean.to_numpy() - sd, mean.to_numpy() + sd
        fig.add_trace(_band(go, x, lo, hi, f"random ({band})", "rgba(128,128,128,0.25)"))
        fig.add_trace(go.Scatter(x=x, y=mean.to_numpy(), mode="lines+markers", name="random (mean)",
                                 line={"color": "gray", "dash": "dash"},
                                 hovertemplate="%{x:.2f}% heads<br>" + y + " %{y:.3f}<extra>random</extra>"))
    top = df[df.selection == "top"].sort_values("fraction")
    if len(top):
        fig.add_trace(go.Scatter(x=top.fraction.to_numpy() * 100, y=top[y].to_numpy(), mode="lines+markers",
                                 name="top-k by score", line={"color": "crimson"}, customdata=top.k.to_numpy(),
                                 hovertemplate="k=%{customdata} (%{x:.2f}% heads)<br>" + y
                                 + " %{y:.3f}<extra>top</extra>"))
    kind = df.attrs.get("kind", "")
    fig.update_layout(title=title or f"knockout ({kind})".replace(" ()", ""), xaxis_title="% of heads knocked out",
                      yaxis_title=y, template="plotly_white")
    return fig


def stability_plot(df, title: str | None = None):
    """Spearman and top-K overlap of the n-sample ranking with the full ranking, vs n (mean and min-max)."""
    go = _go()
    need = {"n", "spearman", "topk_overlap"}
    if not need <= set(df.columns):
        raise ValueError(f"stability_plot: df needs columns {sorted(need)}; pass ranking_stability()'s output")
    fig = go.Figure()
    for col, color, fill in (("spearman", "royalblue", "rgba(65,105,225,0.2)"),
                             ("topk_overlap", "darkorange", "rgba(255,140,0,0.2)")):
        g = df.groupby("n")[col]
        x = g.mean().index.to_numpy()
        fig.add_trace(_band(go, x, g.min().to_numpy(), g.max().to_numpy(), f"{col} (min-max)", fill))
        fig.add_trace(go.Scatter(x=x, y=g.mean().to_numpy(), mode="lines+markers", name=col, line={"color": color}))
    k = int(df["k"].iloc[0]) if "k" in df.columns and len(df) else None
    fig.update_layout(title=title or "ranking stability vs samples" + (f" (top-{k})" if k else ""),
                      xaxis_title="samples n", yaxis_title="agreement with all samples", template="plotly_white",
                      yaxis_range=[min(0.0, float(df[["spearman", "topk_overlap"]].min().min())), 1.05])
    return fig


def similarity_plot(matrix, title: str = "residual-stream cosine similarity between layers"):
    """Heatmap of ``layer_similarity``'s output (or any square matrix)."""
    go = _go()
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"similarity_plot: expected a square matrix, got shape {m.shape}")
    names = [str(c) for c in getattr(matrix, "columns", range(m.shape[0]))]
    fig = go.Figure(go.Heatmap(z=m, x=names, y=names, colorscale="RdBu_r", zmid=float(np.median(m)),
                               hovertemplate="%{y} vs %{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(title=title, template="plotly_white")
    fig.update_yaxes(autorange="reversed")
    return fig


FIGURE_SUFFIXES = (".html", ".htm", ".png")


def _is_figure(path: Path) -> bool:
    """An existing file that a figure may replace: a plotly HTML page or a PNG image."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") or (b"<html" in head.lower() and b"plotly" in head.lower())


def check_png_export(flag: str = "--plot", path: str | Path | None = None, *, probe: bool = True) -> None:
    """Raise PngExportError unless a PNG can be written: kaleido is installed and, with ``probe``, exports a
    blank figure (kaleido 1.x needs a Chrome/Chromium; about a second). Call it before long work."""
    where = f"{flag} {path}" if path is not None else flag
    try:
        import kaleido  # noqa: F401
    except ImportError:
        raise PngExportError(f"{where}: PNG export needs kaleido, which is not installed: {PNG_HINT}; or give a "
                             ".html path (nothing was computed)") from None
    if probe:
        go = _go()
        try:
            go.Figure().to_image(format="png", width=10, height=10)
        except Exception as err:  # kaleido without a browser, etc.
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise PngExportError(f"{where}: PNG export does not work here ({msg}): {PNG_HINT}; or give a .html "
                                 "path (nothing was computed)") from None


def check_figure_path(path: str | Path, *, overwrite: bool = False, flag: str = "--plot",
                      check_exporter: bool = True) -> Path:
    """Refuse a figure path that ``save`` cannot or should not write, before long work starts: a folder, a
    suffix other than .html/.png, an existing file that is not a figure (unless ``overwrite``), and, with
    ``check_exporter``, a .png when the PNG exporter (kaleido and its browser) does not work."""
    from headscope.io import OutputExistsError, check_output_path

    p = Path(path)
    if p.suffix.lower() not in FIGURE_SUFFIXES:
        raise ValueError(f"{flag} {p}: a figure must end in .html or .png (got {p.suffix or 'no suffix'!r})")
    if p.exists() and not p.is_dir() and not overwrite and not _is_figure(p):
        raise OutputExistsError(f"{flag} {p} exists and is not a figure; refusing to overwrite it (pass "
                                "--overwrite / overwrite=True, or choose another path)")
    out = check_output_path(p, kind=None, overwrite=True, flag=flag)
    if check_exporter and p.suffix.lower() == ".png":
        check_png_export(flag, p)
    return out


def save(fig, path: str | Path, *, include_plotlyjs: "bool | str" = True) -> Path:
    """Write ``fig`` as HTML; for a ``.png`` path write ``.html`` beside it, then the PNG (needs kaleido).

    ``include_plotlyjs=True`` embeds plotly.js (~4.6 MB, opens offline); ``"cdn"`` links it (~10 KB files).
    Both files are written atomically (headscope.io): a kill or a full disk leaves an old figure intact.

    Returns the path written last. Raises PngExportError naming the install when kaleido is missing.
    """
    from headscope.io import write_bytes, write_text

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FIGURE_SUFFIXES:
        raise ValueError(f"save: {path.name} must end in .html or .png (nothing written)")
    html = path if suffix in (".html", ".htm") else path.with_suffix(".html")
    write_text(html, fig.to_html(include_plotlyjs=include_plotlyjs))
    if suffix in (".html", ".htm"):
        return html
    try:
        import kaleido  # noqa: F401
    except ImportError:
        raise PngExportError(f"PNG export needs kaleido: {PNG_HINT}. The HTML figure was written to {html}") from None
    try:
        data = fig.to_image(format="png")
    except Exception as err:  # kaleido without a browser, etc.
        raise PngExportError(f"PNG export failed ({err}); {PNG_HINT}. The HTML figure was written to {html}") from None
    write_bytes(path, data)
    return path
