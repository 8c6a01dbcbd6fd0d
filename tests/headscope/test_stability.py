"""Ranking stability under subsampling."""
import pytest
import torch

from headscope.results import HeadScores
from headscope.stability import ranking_stability, samples_to_stabilize, topk_overlap


def _noisy(n=12, noise=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.linspace(0, 1, 48).view(4, 12)
    return HeadScores("t", base + noise * torch.randn(n, 4, 12, generator=g))


def test_agreement_grows_with_samples_and_is_exact_at_n():
    df = ranking_stability(_noisy(), k=5, n_boot=10)
    assert set(df.columns) >= {"n", "boot", "spearman", "topk_overlap", "k"}
    means = df.groupby("n")[["spearman", "topk_overlap"]].mean()
    assert means.loc[12, "spearman"] == pytest.approx(1.0) and means.loc[12, "topk_overlap"] == 1.0
    assert means.loc[1, "spearman"] < means.loc[6, "spearman"] < means.loc[12, "spearman"]
    assert (df.groupby("n").size().drop(12) == 10).all() and (df.n == 12).sum() == 1


def test_samples_to_stabilize():
    df = ranking_stability(_noisy(noise=0.05), n_boot=5)
    n = samples_to_stabilize(df, 0.9)
    assert n is not None and 1 <= n <= 12
    means = df.groupby("n").spearman.mean()
    assert (means.loc[n:] >= 0.9).all()
    assert samples_to_stabilize(ranking_stability(_noisy(noise=50.0), n_boot=3), 0.999) == 12


def test_topk_overlap():
    assert topk_overlap([3, 2, 1, 0], [3, 2, 0, 1], 2) == 1.0
    assert topk_overlap([3, 2, 1, 0], [0, 1, 2, 3], 2) == 0.0


def test_errors():
    with pytest.raises(ValueError, match="at least 2"):
        ranking_stability(HeadScores("t", torch.rand(1, 2, 2)))
    with pytest.raises(ValueError, match="outside"):
        ranking_stability(_noisy(), ns=[0, 3])
    with pytest.raises(ValueError, match="column"):
        samples_to_stabilize(ranking_stability(_noisy(), n_boot=2).drop(columns="spearman"))
