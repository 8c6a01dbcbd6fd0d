"""Stability weighting, receiver+sender combination, task fusion (by class), the fusion registries."""
import warnings
from pathlib import Path

import pytest
import torch

from headscope.fusion import (COMBINE_RULES, DEFAULT_TASK_CLASSES, NORMALIZE_MODES, STABILITY_METHODS, combine, fuse,
                              signal_maps, stability_weight, task_class)
from headscope.heads import Head
from headscope.results import HeadScores

REFERENCE = Path(__file__).parent / "data" / "niah_reference_scores.json"  # real per-sample scores, 8 x 8 x 8


def _scores(task="niah", n=6, L=3, H=4, seed=0, kind="receiver"):
    g = torch.Generator().manual_seed(seed)
    return HeadScores(task, per_sample_raw=torch.rand(n, L, H, generator=g) * 1.4 - 0.2, kind=kind, n_kv_heads=2)


def test_frac_is_mean_times_soft_fraction():
    s = _scores()
    ps = s.per_sample_raw.clamp(0, 1)
    want = ps.mean(0) * (ps / 0.3).clamp(max=1).mean(0)
    torch.testing.assert_close(stability_weight(s, "frac", threshold=0.3), want)
    torch.testing.assert_close(stability_weight(s), ps.mean(0) * (ps / 0.1).clamp(max=1).mean(0))  # the default
    torch.testing.assert_close(stability_weight(s, "none"), ps.mean(0))


def test_hard_frac_is_mean_times_fraction_above_threshold():
    s = _scores()
    ps = s.per_sample_raw.clamp(0, 1)
    want = ps.mean(0) * (ps > 0.3).double().mean(0)
    torch.testing.assert_close(stability_weight(s, "hard_frac", threshold=0.3), want)


def test_one_task_on_real_scores_keeps_most_heads_weighted():
    """The reference model's NIAH receiver scores (8 samples): the hard fraction zeroes 62 of 64 heads,
    the default soft fraction keeps every head that scored > 0 on some sample, and their order."""
    s = HeadScores.from_json(REFERENCE)
    assert (s.n_samples, s.n_layers, s.n_heads) == (8, 8, 8)
    hard, soft = stability_weight(s, "hard_frac"), stability_weight(s)
    assert int((hard == 0).sum()) >= 60  # the old default: almost every head gets 0
    some_signal = (s.per_sample > 0).any(0)  # [L, H]
    assert (soft[some_signal] > 0).all() and int((soft > 0).sum()) >= 0.9 * soft.numel()
    weak = hard == 0  # among the heads the hard fraction zeroes, the soft weights still rank them
    assert len(set(soft[weak].tolist())) > 0.9 * int(weak.sum())
    assert (soft <= s.scores + 1e-12).all()
    fused = fuse({"niah": s})
    assert int((fused.scores > 0).sum()) >= 0.9 * soft.numel()


def test_head_important_in_one_of_eight_ranks_below_one_important_in_all():
    s = HeadScores.from_json(REFERENCE)
    ps = s.per_sample_raw.clone()  # [8, L, H]: two heads of layer 7 get the same mean 0.125
    ps[:, 7, 0] = 0.125  # important in 8 of 8 samples
    ps[:, 7, 1] = 0.0
    ps[0, 7, 1] = 1.0  # important in 1 of 8 samples
    s2 = HeadScores("niah", ps, n_kv_heads=4)
    assert float(s2.scores[7, 0]) == pytest.approx(float(s2.scores[7, 1]))
    for method in ("frac", "hard_frac", "snr"):
        ranking = HeadScores("w", stability_weight(s2, method)[None]).ranking()
        assert ranking.index(Head(7, 0)) < ranking.index(Head(7, 1)), method
    w = stability_weight(s2)
    assert w[7, 1] > 0 and w[7, 0] == pytest.approx(0.125)  # tau = 0.1 reached on every sample: full weight


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


# ---- task classes ------------------------------------------------------------------------------------

def test_fuse_weighs_the_two_classes_equally_not_the_task_names():
    niah, ar, bi, co = (_scores(t, seed=i) for i, t in enumerate(("niah", "arithmetic", "binding", "comparison")))
    fused = fuse({"niah": niah, "arithmetic": ar, "binding": bi, "comparison": co})
    w = {t: stability_weight(x) for t, x in (("niah", niah), ("arithmetic", ar), ("binding", bi), ("comparison", co))}
    want = 0.5 * w["niah"] + (w["arithmetic"] + w["binding"] + w["comparison"]) / 6
    torch.testing.assert_close(fused.scores, want)
    st = fused.settings
    assert st["classes"] == {"retrieval": ["niah"], "reasoning": ["arithmetic", "binding", "comparison"]}
    assert st["weights_from"] == "classes" and st["class_weights"] == {"retrieval": 1.0, "reasoning": 1.0}
    assert st["weights"]["niah"] == pytest.approx(0.5) and st["weights"]["binding"] == pytest.approx(1 / 6)
    assert st["task_class"]["comparison"] == "reasoning"
    back = HeadScores.from_json(fused.to_json())  # the class structure survives the file
    assert back.settings["classes"] == st["classes"]


def test_class_weights_and_custom_classes():
    a, b, c = _scores("niah", seed=1), _scores("niah_multikey", seed=2), _scores("two_hop", seed=3)
    fused = fuse([a, b, c], class_weights={"retrieval": 3, "reasoning": 1}, stability="none")
    torch.testing.assert_close(fused.scores, 0.75 * (a.scores + b.scores) / 2 + 0.25 * c.scores)
    mine = fuse({"mine": _scores("mine", seed=4), "niah": a}, classes={"mine": "retrieval"}, stability="none")
    torch.testing.assert_close(mine.scores, (_scores("mine", seed=4).scores + a.scores) / 2)
    assert mine.settings["classes"] == {"retrieval": ["mine", "niah"]}
    assert task_class("niah_4k") == ("retrieval", True) and task_class("niah#2") == ("retrieval", True)
    assert task_class("arithmetic")[0] == "reasoning" and set(DEFAULT_TASK_CLASSES.values()) == {"retrieval",
                                                                                                "reasoning"}


def test_unknown_task_is_its_own_class_with_a_warning():
    with pytest.warns(UserWarning, match="no known class"):
        fused = fuse({"niah": _scores("niah"), "custom": _scores("custom", seed=3)})
    assert fused.settings["classes"] == {"retrieval": ["niah"], "custom": ["custom"]}
    with warnings.catch_warnings():  # explicit task weights ignore the classes: no warning
        warnings.simplefilter("error")
        fuse({"niah": _scores("niah"), "custom": _scores("custom", seed=3)}, weights=[1, 1])


@pytest.mark.parametrize("kw, message", [
    (dict(weights=[1, 1], class_weights={"retrieval": 1, "reasoning": 1}), "not both"),
    (dict(class_weights={"retrieval": 1}), "no weight to the classes"),
    (dict(class_weights={"retrieval": 0, "reasoning": 0}), "positive sum"),
    (dict(class_weights={"retrieval": -1, "reasoning": 2}), ">= 0"),
    (dict(normalize="l2"), "normalize"),
    (dict(stability="median"), "stability"),
])
def test_fuse_refuses_bad_weights_and_modes(kw, message):
    with pytest.raises(ValueError, match=message):
        fuse({"niah": _scores("niah"), "arithmetic": _scores("arithmetic", seed=2)}, **kw)


# ---- non-finite scores ------------------------------------------------------------------------------

def _with(value, task="niah", kind="receiver"):
    s = _scores(task, kind=kind)
    s.per_sample_raw[2, 1, 3] = value
    return s


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scores_are_refused(value):
    with pytest.raises(ValueError, match="NaN|infinite"):
        stability_weight(_with(value))
    with pytest.raises(ValueError, match=r"task 'niah'.*(NaN|infinite).*L1H3 on sample 2"):
        fuse({"niah": _with(value), "arithmetic": _scores("arithmetic")})
    with pytest.raises(ValueError, match="receiver scores .*(NaN|infinite)"):
        combine(_with(value), _scores(kind="sender"))


def test_combine_refuses_infinite_senders_but_nan_means_not_scored():
    with pytest.raises(ValueError, match="sender scores .*infinite"):
        combine(_scores(), _with(float("inf"), kind="sender"))
    out = combine(_scores(), _with(float("nan"), kind="sender"))  # NaN sender: "not scored", takes the receiver
    assert torch.isfinite(out.per_sample_raw).all()


# ---- unweighted maps --------------------------------------------------------------------------------

def test_combine_and_fuse_keep_the_unweighted_maps():
    r, s = _scores(seed=1), _scores(seed=2, kind="sender")
    both = combine(r, s)
    maps = signal_maps(both)
    torch.testing.assert_close(maps["receiver"], r.scores)
    torch.testing.assert_close(maps["sender"], s.scores)
    reason = _scores("arithmetic", seed=3)
    fused = HeadScores.from_json(fuse({"niah": both, "arithmetic": reason}).to_json())
    fm = signal_maps(fused)
    torch.testing.assert_close(fm["receiver"], (r.scores + reason.scores) / 2)  # class-weighted average
    torch.testing.assert_close(fm["sender"], s.scores)  # only niah has senders
    torch.testing.assert_close(fm["receiver:arithmetic"], reason.scores)
    assert set(fm) == {"score", "receiver", "sender", "receiver:niah", "sender:niah", "receiver:arithmetic"}


# ---- registries -------------------------------------------------------------------------------------

def test_a_new_stability_method_is_one_registry_entry():
    STABILITY_METHODS.register("median", lambda s, threshold, c: s.median(0).values)
    try:
        x = _scores()
        torch.testing.assert_close(stability_weight(x, "median"), x.per_sample.median(0).values)
        fused = fuse({"niah": x}, stability="median")
        assert fused.settings["stability"] == "median"
    finally:
        STABILITY_METHODS.unregister("median")
    with pytest.raises(ValueError, match="is not one of"):
        stability_weight(_scores(), "median")


def test_a_new_combine_rule_and_normalize_mode_are_registry_entries():
    COMBINE_RULES.register("min", lambda r, s, weight: torch.minimum(r, s))
    NORMALIZE_MODES.register("double", lambda w: 2 * w)
    try:
        r, s = _scores(seed=1), _scores(seed=2, kind="sender")
        torch.testing.assert_close(combine(r, s, rule="min").per_sample_raw,
                                   torch.minimum(r.per_sample_raw, s.per_sample_raw))
        torch.testing.assert_close(fuse({"niah": r}, normalize="double", stability="none").raw, 2 * r.scores)
    finally:
        COMBINE_RULES.unregister("min")
        NORMALIZE_MODES.unregister("double")
    assert list(COMBINE_RULES) == ["max", "mean", "receiver", "weighted"]
    with pytest.raises(ValueError, match="already registered"):
        COMBINE_RULES.register("max", lambda r, s, weight: r)
