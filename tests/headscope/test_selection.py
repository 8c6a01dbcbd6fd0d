"""Head selection strategies, baselines and GQA group scores."""
import pytest
import torch

from headscope.heads import Head
from headscope.mask import HeadMask, MaskError
from headscope.results import HeadScores
from headscope.selection import (budget, fixed_ratio, kv_group_scores, layerwise, parse_ratio, random_global,
                                 random_per_layer, select)


def _map(L=4, H=4, seed=0):
    return torch.rand(L, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_global_top_k():
    s = _map()
    mask = select(s, k=5)
    order = sorted(((float(s[l, h]), Head(l, h)) for l in range(4) for h in range(4)), reverse=True)
    assert set(mask.fa_heads) == {h for _, h in order[:5]}
    assert mask.settings["strategy"] == "global" and mask.settings["k"] == 5
    assert mask.scores is not None and mask.scores[0][0] == pytest.approx(float(s[0, 0]))


def test_global_per_layer_min_fills_empty_layers_and_keeps_k():
    s = torch.zeros(3, 4, dtype=torch.float64)
    s[0] = torch.tensor([0.9, 0.8, 0.7, 0.6])
    s[1] = torch.tensor([0.5, 0.4, 0.01, 0.0])
    s[2] = torch.tensor([0.0, 0.03, 0.02, 0.0])  # never in the global top-4
    assert select(s, k=4).per_layer_counts() == [4, 0, 0]
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
    assert len(select(_map(8, 16), ratio="7:1")) == 16
    for kw, msg in [({"k": 17}, "outside"), ({"k": 0}, "outside"), ({"fraction": 0.0}, "fraction"),
                    ({"fraction": 1.5}, "fraction"), ({"ratio": "seven"}, "LA:FA"), ({"ratio": "7:0"}, "FA part"),
                    ({}, "exactly one"), ({"k": 2, "ratio": "1:1"}, "exactly one")]:
        with pytest.raises(ValueError, match=msg):
            select(_map(), **kw)
    with pytest.raises(ValueError, match="k >= n_layers"):
        select(_map(), k=3, strategy="global_per_layer_min")
    with pytest.raises(ValueError, match="strategy"):
        select(_map(), k=3, strategy="best")


def test_seed_breaks_ties_randomly_but_reproducibly():
    flat = torch.zeros(4, 4, dtype=torch.float64)
    assert select(flat, k=3).fa_heads == (Head(0, 0), Head(0, 1), Head(0, 2))
    a, b = select(flat, k=3, seed=1), select(flat, k=3, seed=1)
    assert a.fa_heads == b.fa_heads and a.settings["seed"] == 1


def test_baselines():
    shape = (6, 8, 2)
    a, b, c = (random_per_layer(shape, k=12, seed=s) for s in (0, 0, 1))
    assert a.per_layer_counts() == [2] * 6 and a.fa_heads == b.fa_heads and a.fa_heads != c.fa_heads
    assert sorted(random_per_layer(shape, k=14, seed=0).per_layer_counts()) == [2, 2, 2, 2, 3, 3]
    g = random_global(shape, k=5, seed=0)
    assert len(g) == 5 and g.settings == {"strategy": "random_global", "k": 5, "seed": 0}
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
        select(torch.rand(2, 4), k=2, model=tiny_qwen3)


def test_kv_group_scores():
    s = HeadScores("t", torch.tensor([[[0.1, 0.5, 0.2, 0.2]]]), n_kv_heads=2)
    torch.testing.assert_close(kv_group_scores(s), torch.tensor([[0.5, 0.2]], dtype=torch.float64))
    torch.testing.assert_close(kv_group_scores(s, reduce="mean"), torch.tensor([[0.3, 0.2]], dtype=torch.float64))
    torch.testing.assert_close(kv_group_scores(s, reduce="sum"), torch.tensor([[0.6, 0.4]], dtype=torch.float64))
    with pytest.raises(ValueError, match="divide"):
        kv_group_scores(s, n_kv_heads=3)
