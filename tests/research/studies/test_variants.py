"""research.studies.variants: variant specs, their masks and shares, infeasible budgets, the cached teacher scores."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from research.studies.variants import InfeasibleVariant, VariantSpec, build_variant, selection_scores
from model_factories import tiny_model

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
    (dict(kind="learned", strategy="random_global"), "ranks its gates"),
    (dict(kind="learned", fraction=None), "exactly one budget"),
    (dict(selector={"steps": 3}), "only a variant of kind 'learned'"),
    (dict(kind="learned", selector={"steps": 0}), "SelectorConfig.steps=0"),
    (dict(kind="learned", selector=[1]), "selector"),
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


def test_tuned_teacher_is_the_teacher_as_a_hybrid_with_nothing_new(tiny_qwen3):
    """Kind "tuned_teacher": every head FA with its RoPE and no merge norm, so the built model computes the teacher's
    function (equal logits) and has no new parameters: the kind says so, and the study skips stage 1 for it."""
    from hybrid.convert import from_mask
    from research.studies.variants import VARIANT_KINDS

    b = build_variant(VariantSpec(name="teacher-tuned", kind="tuned_teacher"), tiny_qwen3, seed=0,
                      base_options={"gdn_fold_heads": True})
    L, H = tiny_qwen3.config.num_hidden_layers, tiny_qwen3.config.num_attention_heads
    assert len(b.mask.fa_heads) == L * H and b.info["kv_share"] == 1.0 and b.info["fa_query_share"] == 1.0
    assert not VARIANT_KINDS.entry("tuned_teacher").new_parameters
    model = from_mask(tiny_qwen3, b.mask, **b.options).eval()
    assert list(model.new_parameters()) == []
    ids = torch.randint(1, tiny_qwen3.config.vocab_size, (2, 12))  # [B, T]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny_qwen3(ids).logits, rtol=1e-5, atol=1e-5)


def test_variant_options_layer_over_the_study_options(tiny_qwen3):
    b = build_variant(spec(unit="head", strategy="random_global", hybrid={"merge": "none"}), tiny_qwen3,
                      base_options={"merge": "gated_head", "gdn_conv": True}, seed=3)
    assert b.options == {"seed": 3, "merge": "none", "gdn_conv": True}


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


def gqa_llama():
    """A tiny Llama with SmolLM2's grouping (3 KV heads per layer) in miniature: 4 layers x 6 query heads."""
    return tiny_model("llama", num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3, hidden_size=48,
                      head_dim=8)


def fake_score(teacher, reasoning_accuracy: float, calls: list):
    """headscope.api.score without a model: NIAH scores with one clear KV group per layer; reasoning raises the
    clean-accuracy failure when the teacher 'solves' fewer prompts than asked."""
    from headscope.patching.engine import CleanFailureError
    from headscope.results import HeadScores

    L, H = teacher.config.num_hidden_layers, teacher.config.num_attention_heads

    def score(model, task, **kw):
        calls.append((task, kw))
        raw = torch.zeros(2, L, H)  # [N, L, H]
        if task == "niah":
            raw[:, 1, 2:4] = 0.8  # layer 1, KV group 1
            raw[:, 3, 4:6] = 0.5  # layer 3, KV group 2
        else:
            if reasoning_accuracy < kw["min_clean_accuracy"]:
                assert kw["on_clean_failure"] == "error"  # checked before any patching
                raise CleanFailureError(f"the model answers only {reasoning_accuracy:.0%} of the clean prompts of "
                                        "task 'reasoning' correctly. Fix: ...")
            raw[:, 0, 0:2] = 0.9  # layer 0, KV group 0
        return HeadScores(task=task, per_sample_raw=raw, n_kv_heads=3, settings={"clean_accuracy": 1.0})

    return score


def test_reasoning_the_teacher_cannot_do_is_left_out_of_the_mask(tmp_path, monkeypatch):
    """SmolLM2-135M solves 62-88% of the reasoning prompts: its mask must come from NIAH alone, not from noise."""
    import headscope.api
    from headscope.selection import select
    from research.studies.variants import make_mask

    teacher, calls = gqa_llama(), []
    monkeypatch.setattr(headscope.api, "score", fake_score(teacher, 0.6, calls))
    with pytest.warns(UserWarning, match="reasoning left out"):
        scores = selection_scores(teacher, None, n_samples=2, context_length=64, path=tmp_path / "s.json",
                                  progress=False, sender_rounds=0)
    assert scores.settings["reasoning_left_out"].startswith("the model answers only 60%")
    assert scores.settings["tasks"] == ["niah"]
    assert [c[0] for c in calls] == ["niah", "reasoning"]
    mask = select(scores, fraction=2 / 12, unit="kv_group", model=teacher, strategy="global")  # 2 of 4 x 3 KV groups
    assert sorted(h.to_list() for h in mask.fa_heads) == [[1, 2], [1, 3], [3, 4], [3, 5]]
    # make_mask (run.py's path) on the GQA teacher: whole KV groups, the cached scores reused
    again = make_mask(teacher, None, 2 / 12, n_samples=2, context_length=64, device="cpu",
                      scores_path=tmp_path / "s.json", sender_rounds=0)
    assert again.fa_heads == mask.fa_heads and len(calls) == 2


def test_reasoning_the_teacher_solves_is_fused(tmp_path, monkeypatch):
    import headscope.api
    from headscope.selection import select

    teacher, calls = gqa_llama(), []
    monkeypatch.setattr(headscope.api, "score", fake_score(teacher, 1.0, calls))
    scores = selection_scores(teacher, None, n_samples=2, context_length=64, progress=False, sender_rounds=0)
    assert scores.settings["reasoning_left_out"] is None and scores.settings["tasks"] == ["niah", "reasoning"]
    mask = select(scores, fraction=1 / 12, unit="kv_group", model=teacher, strategy="global")
    assert sorted(h.to_list() for h in mask.fa_heads) == [[0, 0], [0, 1]]  # reasoning's group (0.9 x 0.5 > 0.8 x 0.5)


def test_sender_scores_enter_the_fusion(tmp_path, monkeypatch):
    """The whole method: per task the receiver scores combined with iterated path patching's sender scores; a
    sender-only head (layer 2, KV group 0 here) can take the budget's one KV group."""
    import headscope.api
    import headscope.senders
    from headscope.results import HeadScores
    from headscope.selection import select

    teacher, calls, rounds = gqa_llama(), [], []
    monkeypatch.setattr(headscope.api, "score", fake_score(teacher, 0.6, calls))

    def fake_ipp(model, task, *, receiver_scores, max_rounds, **kw):
        rounds.append((task, max_rounds, kw["context_length"]))
        raw = receiver_scores.per_sample_raw.clone()  # [N, L, H]
        raw[:, 2, 0:2] = 0.95  # a sender the receiver scores did not see
        return SimpleNamespace(combined=HeadScores(task=task, per_sample_raw=raw, n_kv_heads=3, settings={}))

    monkeypatch.setattr(headscope.senders, "iterated_path_patching", fake_ipp)
    with pytest.warns(UserWarning, match="reasoning left out"):
        scores = selection_scores(teacher, None, n_samples=2, context_length=64, path=tmp_path / "s.json",
                                  progress=False, sender_rounds=2)
    assert rounds == [("niah", 2, 64)] and scores.settings["study_key"]["sender_rounds"] == 2
    mask = select(scores, fraction=1 / 12, unit="kv_group", model=teacher, strategy="global")
    assert sorted(h.to_list() for h in mask.fa_heads) == [[2, 0], [2, 1]]


def test_learned_kind_trains_gates_once_and_makes_the_budgets_mask(tiny_teacher_dir, tmp_path, monkeypatch):
    import research.studies.selector as selector
    from hybrid.train.build import load_teacher
    from hybrid.train.config import DataConfig
    from research.studies.variants import SELECTOR_FILE, BuildContext

    teacher, tok = load_teacher(str(tiny_teacher_dir), torch.device("cpu"))  # 2 layers x 4 heads, 2 KV groups each
    s = VariantSpec(name="learned-kv", kind="learned", unit="kv_group", fraction=0.25, selector={"steps": 2})
    assert s.needs_data and not s.needs_scores and s.trains
    data = DataConfig(corpus="heldout", text=1.0, niah=0.0, multikey=0.0, reasoning=0.0, copy=0.0)
    ctx = BuildContext(tokenizer=tok, data=data, folder=tmp_path,
                       selector={"batch_size": 1, "seq_len": 32, "progress": False, "steps": 5})
    b = build_variant(s, teacher, seed=3, context=ctx, base_options={"gdn_conv": True})
    st = b.mask.settings
    assert st["strategy"] == "learned" and st["unit"] == "kv_group" and len(b.mask.fa_heads) == 2  # 1 of 4 groups
    assert b.info["kv_share"] == pytest.approx(1 / 4) and b.options == {"seed": 3, "gdn_conv": True}
    # the variant's table over the study's; budget, seed and gate unit from the variant
    assert (st["selector"]["steps"], st["selector"]["batch_size"], st["selector"]["seed"]) == (2, 1, 3)
    assert st["selector"]["budget"] == pytest.approx(0.25) and st["selector"]["gate_unit"] == "kv_group"
    assert (tmp_path / SELECTOR_FILE).exists()

    def trained_again(*a, **k):
        raise RuntimeError("trained again")

    monkeypatch.setattr(selector, "train_selector", trained_again)
    again = build_variant(s, teacher, seed=3, context=ctx, base_options={"gdn_conv": True})  # a resumed study
    assert again.mask.fa_heads == b.mask.fa_heads
    with pytest.raises(RuntimeError, match="trained again"):  # other hybrid options: not the cached gates
        build_variant(s, teacher, seed=3, context=ctx)
    with pytest.raises(ValueError, match="BuildContext"):
        build_variant(s, teacher)


def test_every_variant_kind_labels_its_rows():
    """A kind's row label in the study tables lives in its registry entry (VariantKind.describe), read from the saved
    spec: a new kind is one entry, not a branch in study_metrics."""
    from research.studies.metrics import _describe
    from research.studies.variants import VARIANT_KINDS

    specs = {"select": VariantSpec(name="a", strategy="global", unit="kv_group", fraction=0.125),
             "layerwise": VariantSpec(name="b", kind="layerwise", ratio="3:1"),
             "token": VariantSpec(name="c", kind="token", window=257),
             "teacher": VariantSpec(name="d", kind="teacher"),
             "tuned_teacher": VariantSpec(name="e", kind="tuned_teacher"),
             "learned": VariantSpec(name="f", kind="learned", unit="head", k=8)}
    assert set(specs) == set(VARIANT_KINDS.names())
    labels = {k: _describe(s.to_dict()) for k, s in specs.items()}
    assert labels == {"select": "global, 1/8 of the KV groups", "layerwise": "layer-wise 3:1",
                      "token": "token-level, window 257", "teacher": "teacher",
                      "tuned_teacher": "teacher, trained like the hybrids",
                      "learned": "learned gates (global top), 8 query heads"}
    # a variant's own hybrid options follow its kind's label (studies 4-5: rows of one kind and mask)
    opts = VariantSpec(name="g", strategy="global", unit="kv_group", fraction=0.125,
                       hybrid={"fa_rope": True, "fa_log_scale": False})
    assert _describe(opts.to_dict()) == "global, 1/8 of the KV groups; fa_rope=True, fa_log_scale=False"
