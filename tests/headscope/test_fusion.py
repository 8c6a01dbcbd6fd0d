"""Stability weighting, receiver+sender combination, task fusion."""
import pytest
import torch

from headscope.fusion import combine, fuse, stability_weight
from headscope.results import HeadScores


def _scores(task="niah", n=6, L=3, H=4, seed=0, kind="receiver"):
    g = torch.Generator().manual_seed(seed)
    return HeadScores(task, per_sample_raw=torch.rand(n, L, H, generator=g) * 1.4 - 0.2, kind=kind, n_kv_heads=2)


def test_frac_is_mean_times_fraction_above_threshold():
    s = _scores()
    ps = s.per_sample_raw.clamp(0, 1)
    want = ps.mean(0) * (ps > 0.3).double().mean(0)
    torch.testing.assert_close(stability_weight(s, "frac", threshold=0.3), want)
    torch.testing.assert_close(stability_weight(s, "none"), ps.mean(0))


def test_stable_head_beats_spiky_head_with_the_same_mean():
    ps = torch.zeros(8, 1, 2, dtype=torch.float64)
    ps[:, 0, 0] = 0.25  # important on every sample
    ps[:2, 0, 1] = 1.0  # important on 2 of 8 samples: the same mean 0.25
    s = HeadScores("t", ps)
    for method in ("frac", "snr"):
        w = stability_weight(s, method)
        assert w[0, 0] > w[0, 1], method
        assert (w <= s.scores + 1e-12).all(), method
    assert stability_weight(s, "snr")[0, 0] == pytest.approx(0.25)  # zero spread: full weight


def test_snr_formula():
    s = _scores()
    ps = s.per_sample
    m, sd = ps.mean(0), ps.std(0, unbiased=False)
    torch.testing.assert_close(stability_weight(s, "snr", c=1.5), m * (m / (sd + 1e-8) / 1.5).clamp(max=1))


def test_stability_weight_rejects_bad_input():
    with pytest.raises(ValueError, match="method"):
        stability_weight(_scores(), "median")
    with pytest.raises(ValueError, match="threshold"):
        stability_weight(_scores(), "frac", threshold=1.5)


def test_combine_rules_and_nan_senders():
    r, s = _scores(seed=1), _scores(seed=2, kind="sender")
    s.per_sample_raw[:, 0, 0] = float("nan")
    out = combine(r, s, rule="max")
    assert out.kind == "combined" and out.n_samples == r.n_samples
    torch.testing.assert_close(out.per_sample_raw[:, 1:], torch.maximum(r.per_sample_raw, s.per_sample_raw)[:, 1:])
    torch.testing.assert_close(out.per_sample_raw[:, 0, 0], r.per_sample_raw[:, 0, 0])  # NaN sender: receiver
    mean = combine(r, s, rule="mean").per_sample_raw[:, 2]
    torch.testing.assert_close(mean, (r.per_sample_raw[:, 2] + s.per_sample_raw[:, 2]) / 2)
    w = combine(r, s, rule="weighted", weight=0.25).per_sample_raw[:, 2]
    torch.testing.assert_close(w, 0.75 * r.per_sample_raw[:, 2] + 0.25 * s.per_sample_raw[:, 2])
    torch.testing.assert_close(combine(r, s, rule="receiver").per_sample_raw, r.per_sample_raw)
    torch.testing.assert_close(combine(r).per_sample_raw, r.per_sample_raw)


def test_combine_with_different_sample_counts_uses_means():
    r, s = _scores(n=6), _scores(n=3, seed=5, kind="sender")
    out = combine(r, s)
    assert out.n_samples == 1
    torch.testing.assert_close(out.per_sample_raw[0], torch.maximum(r.raw, s.raw))


def test_combine_rejects_mismatch():
    with pytest.raises(ValueError, match="same model"):
        combine(_scores(), _scores(L=4, kind="sender"))
    with pytest.raises(ValueError, match="rule"):
        combine(_scores(), rule="min")


def test_fuse_equal_and_custom_weights():
    a, b = _scores("niah", seed=1), _scores("reasoning", seed=2)
    fused = fuse({"niah": a, "reasoning": b})
    assert fused.kind == "fused" and fused.n_samples == 1 and fused.n_kv_heads == 2
    want = (stability_weight(a) + stability_weight(b)) / 2
    torch.testing.assert_close(fused.scores, want)
    torch.testing.assert_close(torch.tensor(fused.settings["per_task"]["niah"], dtype=torch.float64),
                               stability_weight(a))
    weighted = fuse([a, b], weights={"niah": 3, "reasoning": 1}, stability="none")
    torch.testing.assert_close(weighted.scores, (3 * a.scores + b.scores) / 4)
    normed = fuse([a, b], normalize="max", stability="none")
    torch.testing.assert_close(normed.scores, (a.scores / a.scores.max() + b.scores / b.scores.max()) / 2)
    back = HeadScores.from_json(fused.to_json())
    torch.testing.assert_close(back.scores, fused.scores)


def test_fuse_errors_are_clear():
    with pytest.raises(ValueError, match="differently shaped"):
        fuse([_scores("a"), _scores("b", H=8)])
    with pytest.raises(ValueError, match="missing"):
        fuse({"a": _scores("a"), "b": _scores("b")}, weights={"a": 1.0})
    with pytest.raises(ValueError, match="positive sum"):
        fuse([_scores("a"), _scores("b")], weights=[0, 0])
    with pytest.raises(ValueError, match="no scores"):
        fuse([])


def test_fuse_list_with_repeated_task_names():
    fused = fuse([_scores("niah", seed=1), _scores("niah", seed=2)])
    assert fused.settings["tasks"] == ["niah", "niah#2"]
