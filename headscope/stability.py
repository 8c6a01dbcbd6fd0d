"""How many samples does a head ranking need? Subsample, re-rank, compare with the full ranking.

    df = ranking_stability(niah_scores)          # rows: n, boot, spearman, topk_overlap
    samples_to_stabilize(df, threshold=0.9)      # smallest n whose mean Spearman stays >= 0.9

For each subsample size n, ``n_boot`` random subsets of n samples (without replacement) are drawn;
the mean clipped score over the subset is compared with the mean over all N samples by Spearman
rank correlation over all L*H heads and by top-K overlap |top-K(n) & top-K(all)| / K.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from headscope.results import HeadScores

__all__ = ["ranking_stability", "samples_to_stabilize", "topk_overlap", "default_k"]


def default_k(n_total: int) -> int:
    """Default K for top-K overlaps: 5% of the heads (at least 1); the paper's retrieval set is ~6.5%."""
    return max(1, round(0.05 * n_total))


def _topk(flat: np.ndarray, k: int) -> set[int]:
    order = np.lexsort((np.arange(flat.size), -flat))  # best first, ties by index
    return set(order[:k].tolist())


def topk_overlap(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor, k: int) -> float:
    """|top-k(a) & top-k(b)| / k over flattened score maps."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if a.size != b.size:
        raise ValueError(f"topk_overlap: maps have {a.size} and {b.size} heads")
    if not 1 <= k <= a.size:
        raise ValueError(f"topk_overlap: k={k} is outside 1..{a.size}")
    return len(_topk(a, k) & _topk(b, k)) / k


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")  # a constant map has no ranking
    return float(spearmanr(a, b).statistic)


def ranking_stability(scores: HeadScores, ns: list[int] | None = None, k: int | None = None, n_boot: int = 20,
                      seed: int = 0):
    """DataFrame with one row per (n, boot): n, boot, spearman, topk_overlap, k.

    ``ns`` defaults to 1..N; ``k`` to ``default_k(L*H)``. When n == N there is one subset (all
    samples), so a single row is returned for it. Spearman is NaN when a subset's mean map is constant.
    """
    import pandas as pd

    if not isinstance(scores, HeadScores):
        raise TypeError(f"ranking_stability: expected HeadScores, got {type(scores).__name__}")
    N = scores.n_samples
    if N < 2:
        raise ValueError(f"ranking_stability: needs scores of at least 2 samples, these have {N}"
                         + (" (fused scores keep one map; pass a task's scores)" if scores.kind == "fused" else ""))
    ns = list(range(1, N + 1)) if ns is None else sorted({int(n) for n in ns})
    bad = [n for n in ns if not 1 <= n <= N]
    if bad:
        raise ValueError(f"ranking_stability: ns={bad} are outside 1..{N} (the number of samples)")
    if n_boot < 1:
        raise ValueError(f"ranking_stability: n_boot={n_boot} must be >= 1")
    total = scores.n_layers * scores.n_heads
    k = default_k(total) if k is None else k
    if not 1 <= k <= total:
        raise ValueError(f"ranking_stability: k={k} is outside 1..{total}")
    ps = scores.per_sample.numpy().reshape(N, total)  # [N, L*H]
    full = ps.mean(0)  # [L*H]
    rng = np.random.default_rng(seed)
    rows = []
    for n in ns:
        reps = min(n_boot, math.comb(N, n))  # n == N: one subset
        for b in range(reps):
            idx = rng.choice(N, size=n, replace=False)
            sub = ps[idx].mean(0)  # [L*H]
            rows.append({"n": n, "boot": b, "spearman": _spearman(sub, full),
                         "topk_overlap": topk_overlap(sub, full, k), "k": k})
    return pd.DataFrame(rows)


def samples_to_stabilize(df, threshold: float = 0.9, column: str = "spearman") -> int | None:
    """Smallest n from which the mean ``column`` (over boots) stays >= ``threshold``; None if never."""
    if column not in df.columns:
        raise ValueError(f"samples_to_stabilize: df has no column {column!r}; pass ranking_stability()'s output")
    means = df.groupby("n")[column].mean().sort_index()
    ok = means >= threshold
    for n in means.index:
        if ok.loc[n:].all():
            return int(n)
    return None
