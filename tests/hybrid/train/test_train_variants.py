"""hybrid.train.variants: variant specs, their masks and shares, infeasible budgets, the cached teacher scores."""
from __future__ import annotations

import pytest
import torch

from hybrid.train.variants import InfeasibleVariant, VariantSpec, build_variant, selection_scores

pytestmark = pytest.mark.usefixtures("one_thread")


def spec(**kw) -> VariantSpec:
    return VariantSpec(**{"name": "v", "fraction": 0.125, **kw})


@pytest.mark.parametrize("kw, match", [
    (dict(kind="nope"), "kind"),
    (dict(strategy="best"), "strategy"),
    (dict(unit="layer"), "unit"),
    (dict(ratio="7:1"), "exactly one budget"),
    (dict(name="a/b"), "variant name"),
    (dict(kind="layerwise", fraction=None), "ratio"),
    (dict(kind="token", window=1), "window"),
    (dict(hybrid=[1]), "hybrid"),
])
def test_bad_specs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        spec(**kw)


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match="unknown field"):
        VariantSpec.from_dict({"name": "v", "fraction": 0.125, "budget": 3})


def test_select_budgets_in_heads_and_kv_groups(tiny_qwen3):
    scores = torch.arange(12, dtype=torch.float64).view(3, 4)  # [L, H]: the last layer's heads rank highest
    heads = build_variant(spec(unit="head"), tiny_qwen3, scores=scores)  # 12 heads: round(1.5) = 2
    assert heads.mask.fa_heads and len(heads.mask.fa_heads) == 2
    assert heads.info["fa_query_share"] == pytest.approx(2 / 12)
    assert heads.info["kv_share"] == pytest.approx(1 / 6)  # heads 2, 3 of layer 2 share KV head 1
    kv = build_variant(spec(unit="kv_group"), tiny_qwen3, scores=scores)  # 6 groups: 1
    assert kv.info["kv_share"] == pytest.approx(1 / 6) and kv.info["n_fa_heads"] == 2
    assert kv.options["seed"] == 0 and kv.info["layers_with_fa"] == 1


def test_strategies_that_cannot_meet_a_kv_budget_are_infeasible(tiny_qwen3):
    scores = torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(InfeasibleVariant, match="n_layers"):  # one FA group per layer needs >= 3 groups
        build_variant(spec(unit="kv_group", strategy="global_per_layer_min"), tiny_qwen3, scores=scores)
    with pytest.raises(InfeasibleVariant, match="not the budget's 1"):  # the same group in all 3 layers
        build_variant(spec(unit="kv_group", strategy="fixed_ratio"), tiny_qwen3, scores=scores)


def test_baselines_need_no_scores_and_follow_the_seed(tiny_qwen3):
    s = spec(strategy="random_global", unit="head")
    assert not s.needs_scores and spec().needs_scores
    a = build_variant(s, tiny_qwen3, seed=0).mask.fa_heads
    assert build_variant(s, tiny_qwen3, seed=0).mask.fa_heads == a
    assert any(build_variant(s, tiny_qwen3, seed=k).mask.fa_heads != a for k in range(1, 6))


def test_layerwise_token_and_teacher_shares(tiny_qwen3):
    lw = build_variant(VariantSpec(name="l", kind="layerwise", ratio="2:1"), tiny_qwen3)  # 1 of 3 layers
    assert lw.options["granularity"] == "layer" and lw.info["layers_with_fa"] == 1
    assert lw.info["kv_share"] == pytest.approx(1 / 3) and lw.info["fa_query_share"] == pytest.approx(1 / 3)
    tok = build_variant(VariantSpec(name="t", kind="token", window=257), tiny_qwen3, train_length=2048)
    assert tok.options == {"seed": 0, "granularity": "token", "window": 257}
    assert tok.info["kv_share"] == pytest.approx(256 / 2048) and tok.info["fa_query_share"] == 0
    t = build_variant(VariantSpec(name="teacher", kind="teacher"), tiny_qwen3)
    assert t.mask is None and t.options == {} and t.info["kv_share"] == 1.0


def test_variant_options_layer_over_the_study_options(tiny_qwen3):
    b = build_variant(spec(unit="head", strategy="random_global", hybrid={"fusion": "none"}), tiny_qwen3,
                      base_options={"fusion": "gated_head", "gdn_conv": True}, seed=3)
    assert b.options == {"seed": 3, "fusion": "none", "gdn_conv": True}


def test_selection_scores_are_computed_once(tmp_path, monkeypatch):
    from headscope.reference import load_model

    teacher, tok = load_model("default", device="cpu")
    path = tmp_path / "scores.json"
    first = selection_scores(teacher, tok, n_samples=1, context_length=64, path=path, progress=False)
    assert path.exists() and first.kind == "fused"
    import headscope.api

    def scored_again(*a, **k):
        raise RuntimeError("scored again")

    monkeypatch.setattr(headscope.api, "score", scored_again)
    again = selection_scores(teacher, tok, n_samples=1, context_length=64, path=path, progress=False)
    assert torch.equal(again.scores, first.scores)
    with pytest.raises(RuntimeError, match="scored again"):  # other settings: not the cached scores
        selection_scores(teacher, tok, n_samples=2, context_length=64, path=path, progress=False)
