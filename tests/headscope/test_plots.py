"""Plotly figures: traces, hover data, files."""
import numpy as np
import pandas as pd
import pytest
import torch

from headscope import plots
from headscope.results import HeadScores
from headscope.selection import select


def _scores():
    return HeadScores("niah", torch.rand(5, 3, 4, generator=torch.Generator().manual_seed(0)), n_kv_heads=2)


def test_heatmap_hover_has_layer_head_score_rank_group():
    s = _scores()
    mask = select(s, k=3, strategy="global")
    fig = plots.heatmap(s, mask=mask)
    hm, marks = fig.data
    assert hm.type == "heatmap" and np.asarray(hm.z).shape == (3, 4)
    custom = np.asarray(hm.customdata)  # [L, H, 5]: layer, head, score, rank, kv group
    assert custom.shape == (3, 4, 5)
    best = s.ranking()[0]
    assert custom[best.layer, best.head, 3] == 1 and custom[2, 3, 0] == 2 and custom[2, 3, 1] == 3
    assert custom[2, 3, 4] == 1 and custom[2, 1, 4] == 0  # 2 query heads per KV head
    assert custom[1, 2, 2] == pytest.approx(float(s.scores[1, 2]))
    assert sorted(custom[..., 3].ravel().tolist()) == list(range(1, 13))
    for word in ("layer", "head", "score", "rank", "KV group"):
        assert word in hm.hovertemplate
    assert marks.name == "FA heads" and len(marks.x) == 3


def test_knockout_plot_traces():
    rows = [{"k": k, "fraction": k / 10, "selection": "top", "seed": None, "accuracy": 1 - k / 4, "metric": 0.0}
            for k in range(4)]
    rows += [{"k": k, "fraction": k / 10, "selection": "random", "seed": s, "accuracy": 1 - 0.05 * k * s,
              "metric": 0.0} for k in range(4) for s in range(3)]
    df = pd.DataFrame(rows)
    fig = plots.knockout_plot(df)
    names = [t.name for t in fig.data]
    assert names == ["random (minmax)", "random (mean)", "top-k by score"]
    band = fig.data[0]
    assert band.fill == "toself" and max(band.y) == pytest.approx(1.0) and min(band.y) == pytest.approx(0.7)
    np.testing.assert_allclose(fig.data[1].y, [1.0, 0.95, 0.9, 0.85])
    np.testing.assert_allclose(fig.data[2].x, [0, 10, 20, 30])
    std = plots.knockout_plot(df, band="std")
    assert std.data[0].name == "random (std)"
    with pytest.raises(ValueError, match="columns"):
        plots.knockout_plot(df.drop(columns="selection"))


def test_stability_and_similarity_plots():
    from headscope.stability import ranking_stability

    fig = plots.stability_plot(ranking_stability(_scores(), n_boot=3))
    assert [t.name for t in fig.data] == ["spearman (min-max)", "spearman", "topk_overlap (min-max)", "topk_overlap"]
    sim = pd.DataFrame(np.eye(3), index=["embed", "L0", "L1"], columns=["embed", "L0", "L1"])
    fig = plots.similarity_plot(sim)
    assert list(fig.data[0].x) == ["embed", "L0", "L1"]
    with pytest.raises(ValueError, match="square"):
        plots.similarity_plot(np.zeros((2, 3)))


def test_save_html_and_png(tmp_path):
    fig = plots.heatmap(_scores())
    out = plots.save(fig, tmp_path / "sub" / "h.html")
    assert out.exists() and "plotly" in out.read_text()[:5000].lower()
    try:
        import kaleido  # noqa: F401
        has_kaleido = True
    except ImportError:
        has_kaleido = False
    if not has_kaleido:
        with pytest.raises(plots.PngExportError, match="pip install kaleido"):
            plots.save(fig, tmp_path / "h2.png")
        assert (tmp_path / "h2.html").exists()
    with pytest.raises(ValueError, match=".html or .png"):
        plots.save(fig, tmp_path / "h.svg")


def test_save_can_link_plotlyjs_instead_of_embedding_it(tmp_path):
    import plotly.graph_objects as go

    from headscope import plots

    fig = go.Figure(go.Scatter(x=[0, 1], y=[1, 0]))
    small = plots.save(fig, tmp_path / "cdn.html", include_plotlyjs="cdn")
    big = plots.save(fig, tmp_path / "full.html")
    assert small.stat().st_size < 100_000 < big.stat().st_size
    assert "cdn.plot.ly" in small.read_text()


def test_check_figure_path(tmp_path):
    from headscope.io import OutputExistsError

    fig = plots.heatmap(_scores())
    plots.check_figure_path(tmp_path / "new.html")
    plots.save(fig, tmp_path / "old.html")
    plots.check_figure_path(tmp_path / "old.html")  # a figure may replace a figure
    (tmp_path / "notes.html").write_text("<p>my notes</p>")
    with pytest.raises(OutputExistsError, match="not a figure"):
        plots.check_figure_path(tmp_path / "notes.html")
    plots.check_figure_path(tmp_path / "notes.html", overwrite=True)
    with pytest.raises(ValueError, match=".html or .png"):
        plots.check_figure_path(tmp_path / "x.pdf")
    (tmp_path / "dir.html").mkdir()
    with pytest.raises(IsADirectoryError, match="is a folder"):
        plots.check_figure_path(tmp_path / "dir.html")


def test_heatmap_refuses_a_mask_of_another_shape():
    from headscope.mask import HeadMask

    mask = HeadMask(fa_heads=[(15, 7)], n_layers=16, n_heads=8)
    with pytest.raises(ValueError, match=r"16 layers x 8 heads but the scores are 3 layers x 4 heads"):
        plots.heatmap(_scores(), mask=mask)
