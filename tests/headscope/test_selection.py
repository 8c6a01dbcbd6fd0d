"""Head selection strategies, baselines (by name too), per-layer minimums, GQA units, refusals."""
import warnings
from pathlib import Path

import pytest
import torch

from headscope.fusion import combine, fuse
from headscope.heads import Head
from headscope.mask import HeadMask, MaskError
from headscope.results import HeadScores
from headscope.selection import (STRATEGIES, budget, fixed_ratio, kv_group_scores, layerwise, parse_ratio,
                                 random_global, random_per_layer, register_strategy, select)

REFERENCE = Path(__file__).parent / "data" / "niah_reference_scores.json"  # real per-sample scores, 8 x 8 x 8


def _map(L=4, H=4, seed=0):
    return torch.rand(L, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_global_top_k():
    s = _map()
    mask = select(s, k=5, strategy="global")
    order = sorted(((float(s[l, h]), Head(l, h)) for l in range(4) for h in range(4)), reverse=True)
    assert set(mask.fa_heads) == {h for _, h in order[:5]}
    assert mask.settings["strategy"] == "global" and mask.settings["k"] == 5
    assert mask.scores is not None and mask.scores[0][0] == pytest.approx(float(s[0, 0]))


def test_global_per_layer_min_fills_empty_layers_and_keeps_k():
    s = torch.zeros(3, 4, dtype=torch.float64)
    s[0] = torch.tensor([0.9, 0.8, 0.7, 0.6])
    s[1] = torch.tensor([0.5, 0.4, 0.01, 0.0])
    s[2] = torch.tensor([0.0, 0.03, 0.02, 0.0])  # never in the global top-4
    assert select(s, k=4, strategy="global").per_layer_counts() == [4, 0, 0]
    mask = select(s, k=4, strategy="global_per_layer_min")
    assert len(mask) == 4 and min(mask.per_layer_counts()) >= 1
    assert set(mask.fa_heads) == {Head(0, 0), Head(0, 1), Head(1, 0), Head(2, 1)}  # 0.7, 0.6 dropped for L1, L2


def test_per_layer_distributes_remainder_by_next_best():
    s = _map(L=3, H=4, seed=3)
    mask = select(s, k=7, strategy="per_layer")
    counts = mask.per_layer_counts()
    assert sum(counts) == 7 and sorted(counts) == [2, 2, 3]
    for l in range(3):
        kept = mask.fa_in_layer(l)
        best = sorted(range(4), key=lambda h: -float(s[l, h]))[:len(kept)]
        assert set(kept) == set(best)


def test_budgets():
    assert parse_ratio("7:1") == 7.0 and parse_ratio("3:2") == 1.5 and parse_ratio(3) == 3.0
    assert budget(448, ratio="7:1") == 56
    assert budget(448, fraction=0.065) == 29
    assert len(select(_map(8, 16), ratio="7:1", strategy="global")) == 16
    for kw, msg in [({"k": 17}, "outside"), ({"k": 0}, "outside"), ({"fraction": 0.0}, "fraction"),
                    ({"fraction": 1.5}, "fraction"), ({"ratio": "seven"}, "LA:FA"), ({"ratio": "7:0"}, "FA part"),
                    ({}, "exactly one"), ({"k": 2, "ratio": "1:1"}, "exactly one")]:
        with pytest.raises(ValueError, match=msg):
            select(_map(), **kw)
    with pytest.raises(ValueError, match="k >= n_layers"):
        select(_map(), k=3, strategy="global_per_layer_min")
    with pytest.raises(ValueError, match="strategy"):
        select(_map(), k=3, strategy="best")


@pytest.mark.filterwarnings("ignore:select. .* carry no causal signal")
def test_seed_breaks_ties_randomly_but_reproducibly():
    flat = torch.zeros(4, 4, dtype=torch.float64)
    assert select(flat, k=3, strategy="global").fa_heads == (Head(0, 0), Head(0, 1), Head(0, 2))
    a, b = select(flat, k=3, seed=1, strategy="global"), select(flat, k=3, seed=1, strategy="global")
    assert a.fa_heads == b.fa_heads and a.settings["seed"] == 1


def test_baselines():
    shape = (6, 8, 2)
    a, b, c = (random_per_layer(shape, k=12, seed=s) for s in (0, 0, 1))
    assert a.per_layer_counts() == [2] * 6 and a.fa_heads == b.fa_heads and a.fa_heads != c.fa_heads
    assert sorted(random_per_layer(shape, k=14, seed=0).per_layer_counts()) == [2, 2, 2, 2, 3, 3]
    g = random_global(shape, k=5, seed=0)
    assert len(g) == 5 and {k: g.settings[k] for k in ("strategy", "k", "seed", "unit")} == {
        "strategy": "random_global", "k": 5, "seed": 0, "unit": "head"}
    f = fixed_ratio(shape, "3:1")
    assert all(f.fa_in_layer(l) == (0, 1) for l in range(6)) and f.n_kv_heads == 2
    lw = layerwise((28, 16), "3:1")
    assert lw.settings["layers"] == list(range(3, 28, 4)) and len(lw) == 7 * 16
    assert layerwise((4, 2), "7:1").settings["layers"] == [3]


def test_masks_for_a_model_carry_the_fingerprint(tiny_qwen3):
    scores = HeadScores("niah", torch.rand(4, 3, 4), n_kv_heads=2)
    mask = select(scores, k=3, strategy="global_per_layer_min", model=tiny_qwen3)
    assert mask.fingerprint and mask.n_kv_heads == 2 and mask.model_type == "qwen3"
    mask.validate_for(tiny_qwen3, require_fa_per_layer=True)
    back = HeadMask.from_json(mask.to_json())
    assert back.fa_heads == mask.fa_heads and back.settings["strategy"] == "global_per_layer_min"
    assert random_per_layer(tiny_qwen3, k=3).fingerprint == mask.fingerprint
    with pytest.raises(MaskError, match="score this model"):
        select(torch.rand(2, 4), k=2, model=tiny_qwen3, strategy="global")


def test_kv_group_scores():
    s = HeadScores("t", torch.tensor([[[0.1, 0.5, 0.2, 0.2]]]), n_kv_heads=2)
    torch.testing.assert_close(kv_group_scores(s), torch.tensor([[0.5, 0.2]], dtype=torch.float64))
    torch.testing.assert_close(kv_group_scores(s, reduce="mean"), torch.tensor([[0.3, 0.2]], dtype=torch.float64))
    torch.testing.assert_close(kv_group_scores(s, reduce="sum"), torch.tensor([[0.6, 0.4]], dtype=torch.float64))
    with pytest.raises(ValueError, match="divide"):
        kv_group_scores(s, n_kv_heads=3)


# ---- per-layer minimum: a layer's best head by the unweighted scores, never by index -----------------

def _receiver(ps):
    return HeadScores("niah", torch.as_tensor(ps, dtype=torch.float64), n_kv_heads=2)


def test_per_layer_minimum_uses_the_unweighted_receiver_score():
    ps = torch.zeros(8, 3, 4, dtype=torch.float64)  # [N, L, H]
    ps[:, 0, :3] = torch.tensor([0.9, 0.8, 0.7])  # layer 0: strong on every sample, fills the global top 3
    ps[0, 1, 2] = 0.05  # layers 1 and 2: weak, on one sample only -> hard_frac weight 0 everywhere
    ps[0, 2, 3] = 0.02
    ps[1, 2, 1] = 0.01
    fused = fuse({"niah": _receiver(ps)}, stability="hard_frac")
    assert (fused.scores[1:] == 0).all()  # every weighted score of layers 1, 2 is 0
    mask = select(fused, k=3, strategy="global_per_layer_min")
    assert set(mask.fa_heads) == {Head(0, 0), Head(1, 2), Head(2, 3)}  # not L1H0 / L2H0 by index
    assert mask.settings["n_no_signal"] == 0 and mask.settings["filled_layers"] == [1, 2]


def test_per_layer_minimum_breaks_receiver_ties_by_sender_score():
    ps = torch.zeros(4, 2, 4, dtype=torch.float64)
    ps[:, 0, 1] = 0.7  # layer 1 has no receiver signal at all
    send = torch.zeros(4, 2, 4, dtype=torch.float64)
    send[:, 1, 3] = 0.01  # ... but L1H3 is a (weak) sender
    both = combine(_receiver(ps), HeadScores("niah", send, kind="sender", n_kv_heads=2), rule="receiver")
    mask = select(fuse({"niah": both}), k=2, strategy="global_per_layer_min")
    assert set(mask.fa_heads) == {Head(0, 1), Head(1, 3)}
    assert mask.settings["n_no_signal"] == 0


def test_heads_without_any_signal_are_counted_and_warned_about():
    ps = torch.zeros(4, 3, 4, dtype=torch.float64)
    ps[:, 0, 0] = 0.5
    ps[:, 1, 2] = 0.3  # layer 2: no signal in any map
    with pytest.warns(UserWarning, match="1 of 3 FA heads carry no causal signal"):
        mask = select(fuse({"niah": _receiver(ps)}), k=3, strategy="global_per_layer_min")
    assert mask.settings["n_no_signal"] == 1 and mask.settings["no_signal_heads"] == [[2, 0]]
    text = mask.summary()
    assert "no causal signal: 1 of 3 FA heads" in text and "L2H0" in text and "WARNING" in text
    back = HeadMask.from_json(mask.to_json())
    assert back.settings["n_no_signal"] == 1


def test_reference_niah_scores_give_a_mask_without_placeholders():
    """The issue's case: one task, 7:1, at least one FA head per layer, on the reference model's scores."""
    niah = HeadScores.from_json(REFERENCE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no causal signal" warning
        mask = select(fuse({"niah": niah}), ratio="7:1", strategy="global_per_layer_min")
    assert len(mask) == 8 and mask.per_layer_counts() == [1] * 8 and mask.settings["n_no_signal"] == 0
    for h in mask.fa_heads:  # each layer's head is its best by the plain receiver score (all positive here)
        layer = niah.scores[h.layer]
        assert float(layer[h.head]) == float(layer.max()) > 0
    old_way = fuse({"niah": niah}, stability="hard_frac")  # the old default weighting zeroes 7 of 8 layers
    assert int((old_way.scores.amax(1) == 0).sum()) == 7
    assert select(old_way, ratio="7:1", strategy="global_per_layer_min").fa_heads == mask.fa_heads
    # the CLI path (fuse one task, then select) and the README's path (select the receiver scores) agree
    assert select(niah, ratio="7:1", strategy="global_per_layer_min").fa_heads == mask.fa_heads
    assert [str(h) for h in mask.fa_heads] == ["L0H6", "L1H6", "L2H3", "L3H0", "L4H7", "L5H5", "L6H4", "L7H0"]


# ---- baselines and strategies by name ------------------------------------------------------------------

def test_baselines_are_reachable_by_name():
    s = HeadScores("niah", torch.rand(3, 6, 8, generator=torch.Generator().manual_seed(0)), n_kv_heads=2)
    assert {"global", "global_per_layer_min", "per_layer", "random_global", "random_per_layer", "fixed_ratio",
            "layerwise"} <= set(STRATEGIES)
    assert select(s, k=12, strategy="random_per_layer", seed=3).fa_heads == random_per_layer((6, 8, 2), 12, 3).fa_heads
    assert select(s, k=5, strategy="random_global", seed=1).fa_heads == random_global((6, 8, 2), 5, 1).fa_heads
    assert select(s, k=5, strategy="random_global").settings["seed"] == 0  # random baselines are always seeded
    assert select(s, ratio="3:1", strategy="fixed_ratio").fa_heads == fixed_ratio((6, 8, 2), "3:1").fa_heads
    assert select(s, k=12, strategy="fixed_ratio", heads=[1, 5]).settings["heads"] == [1, 5]
    lw = select(s, ratio="2:1", strategy="layerwise")
    assert lw.fa_heads == layerwise((6, 8), "2:1").fa_heads and lw.settings["layers"] == [2, 5]
    rnd = select(s, k=5, strategy="random_global")
    assert rnd.scores is not None and "n_no_signal" in rnd.settings  # the baseline's heads are scored too


def test_a_new_strategy_is_one_registry_entry():
    register_strategy("worst", lambda inp: inp.order()[::-1][:inp.k])
    try:
        s = _map()
        mask = select(s, k=2, strategy="worst")
        want = sorted(((float(s[l, h]), Head(l, h)) for l in range(4) for h in range(4)))[:2]
        assert set(mask.fa_heads) == {h for _, h in want} and mask.settings["strategy"] == "worst"
    finally:
        STRATEGIES.unregister("worst")
    with pytest.raises(ValueError, match="is not one of"):
        select(_map(), k=2, strategy="worst")
    register_strategy("broken", lambda inp: [0, 0])
    try:
        with pytest.raises(RuntimeError, match="must be distinct"):
            select(_map(), k=2, strategy="broken")
    finally:
        STRATEGIES.unregister("broken")


# ---- GQA: KV groups ---------------------------------------------------------------------------------

def test_mask_records_the_kv_heads_and_cache_share():
    s = torch.zeros(2, 8, dtype=torch.float64)  # 2 layers x 8 heads, 4 KV heads (groups of 2)
    s[0, 0], s[0, 1], s[1, 5] = 0.9, 0.8, 0.7
    mask = select(s, k=3, n_kv_heads=4, strategy="global")
    assert mask.fa_kv_heads == ((0,), (2,)) and mask.n_fa_kv == 2 and mask.kv_cache_share == pytest.approx(2 / 8)
    data = mask.to_dict()
    assert data["fa_kv_heads"] == [[0], [2]] and data["kv_cache_share"] == pytest.approx(0.25)


def test_kv_group_unit_keeps_whole_groups_ranked_by_kv_group_scores():
    s = torch.rand(4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scores = HeadScores("niah", s[None], n_kv_heads=4)
    # 1/8 of 16 groups = 2 groups = 4 query heads
    mask = select(scores, fraction=1 / 8, unit="kv_group", strategy="global")
    groups = kv_group_scores(scores)  # [4, 4], max over each pair of query heads
    best = sorted(range(16), key=lambda i: -float(groups.flatten()[i]))[:2]
    assert set(mask.fa_heads) == {Head(i // 4, 2 * (i % 4) + j) for i in best for j in (0, 1)}
    assert mask.kv_cache_share == pytest.approx(1 / 8) and len(mask) == 4
    assert mask.settings["unit"] == "kv_group" and mask.settings["k"] == 2 and mask.settings["n_fa_heads"] == 4
    assert select(scores, ratio="7:1", unit="kv_group", strategy="global").fa_heads == mask.fa_heads
    summed = select(scores, k=2, unit="kv_group", kv_reduce="sum", strategy="global")
    best_sum = sorted(range(16), key=lambda i: -float(kv_group_scores(scores, reduce="sum").flatten()[i]))[:2]
    assert {(h.layer, h.head // 2) for h in summed.fa_heads} == {(i // 4, i % 4) for i in best_sum}
    per_layer = select(scores, k=4, unit="kv_group", strategy="global_per_layer_min")
    assert per_layer.per_layer_counts() == [2, 2, 2, 2] and per_layer.kv_cache_share == pytest.approx(0.25)
    rnd = select(scores, k=4, unit="kv_group", strategy="random_per_layer", seed=0)
    assert rnd.per_layer_counts() == [2, 2, 2, 2] and rnd.n_fa_kv == 4
    assert random_global((4, 8, 4), k=3, unit="kv_group").n_fa_kv == 3


def test_head_unit_on_a_model_records_the_teacher_share(tiny_qwen3):
    scores = HeadScores("niah", torch.rand(4, 3, 4), n_kv_heads=2)
    mask = select(scores, k=3, strategy="global_per_layer_min", model=tiny_qwen3)
    assert mask.kv_cache_share == pytest.approx(3 / 6)  # one FA head per layer keeps one of 2 KV heads
    assert "KV cache: 3 of 6 KV heads kept (50.0% of the teacher's KV cache)" in mask.summary()


# ---- refusals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("scores, message", [
    (torch.tensor([[0.1, float("nan")], [0.2, 0.3]]), "NaN"),
    (torch.tensor([[0.1, float("inf")], [0.2, 0.3]]), "infinite"),
    (torch.tensor([[0.1, -float("inf")], [0.2, 0.3]]), "infinite"),
    (HeadScores("niah", torch.tensor([[[0.1, float("inf")], [0.2, 0.3]]])), "infinite"),
    (HeadScores("niah", torch.tensor([[[0.1, float("nan")], [0.2, 0.3]]])), "NaN"),
])
def test_select_refuses_non_finite_scores(scores, message):
    with pytest.raises(ValueError, match=f"select: .*{message}"):
        select(scores, k=1, strategy="global")
    with pytest.raises(ValueError, match=message):
        kv_group_scores(scores, n_kv_heads=1)


@pytest.mark.parametrize("kw, error, message", [
    (dict(k=2, unit="group"), ValueError, "unit"),
    (dict(k=2, unit="kv_group"), ValueError, "needs the number of KV heads"),
    (dict(k=2, unit="kv_group", n_kv_heads=3), ValueError, "must divide"),
    (dict(k=2, seed=1.5), TypeError, "seed"),
    (dict(k=2, heads=[0]), TypeError, "takes no option"),
    (dict(k=2, strategy="fixed_ratio", heads=[0, 9]), ValueError, "distinct integer indices"),
    (dict(k=2, kv_reduce="median"), ValueError, "kv_reduce"),
    (dict(k=3, unit="kv_group", n_kv_heads=2, strategy="global_per_layer_min"), ValueError, "k >= n_layers"),
])
def test_select_refuses_bad_arguments(kw, error, message):
    with pytest.raises(error, match=message):
        select(_map(L=4, H=4), **kw)


def test_select_refuses_kv_heads_that_disagree(tiny_qwen3):
    with pytest.raises(ValueError, match="disagrees"):
        select(HeadScores("niah", torch.rand(2, 3, 4), n_kv_heads=4), k=3, model=tiny_qwen3, strategy="global")


def test_the_api_and_the_command_line_default_to_the_methods_strategy():
    """One default: select() without strategy= is the method's global top-K with >= 1 FA head per layer, as the
    command line's --strategy, and the one docs/method.md names as the method's default."""
    import inspect
    from pathlib import Path

    from headscope.cli import build_parser
    from headscope.selection import DEFAULT_STRATEGY

    assert DEFAULT_STRATEGY == "global_per_layer_min"
    assert inspect.signature(select).parameters["strategy"].default == DEFAULT_STRATEGY
    parser = build_parser()
    for command in (["run"], ["select", "--scores", "s.json", "--out", "m.json"]):
        assert parser.parse_args(command).strategy == DEFAULT_STRATEGY
    s = _map(L=3, H=4)
    s[0] = 10.0  # layer 0 holds every top head: the default still gives each layer one
    mask = select(s, k=3)
    assert mask.settings["strategy"] == DEFAULT_STRATEGY and mask.per_layer_counts() == [1, 1, 1]
    assert select(s, k=3, strategy="global").per_layer_counts() == [3, 0, 0]
    with pytest.raises(ValueError, match="k >= n_layers.*strategy='global'"):  # the fix is named
        select(s, k=2)
    method = (Path(__file__).resolve().parents[2] / "docs" / "method.md").read_text()
    row = next(line for line in method.splitlines() if line.startswith("| global top-K with >= 1 FA head per layer"))
    assert "default" in row
