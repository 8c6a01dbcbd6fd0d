"""research.studies.selector: the learned per-head FA/GDN gate (study 7's baseline) on tiny random teachers."""
from __future__ import annotations

import pytest
import torch

from research.studies.selector import SelectorConfig, SelectorResult, selector_mask, train_selector
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def batches(seed: int = 0, B: int = 2, T: int = 32, vocab: int = 128):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab, (B, T), generator=g)  # [B, T]


def cfg(**kw) -> SelectorConfig:
    return SelectorConfig(**{"steps": 8, "batch_size": 2, "seq_len": 32, "progress": False, **kw})


@pytest.mark.parametrize("kw, match", [
    (dict(steps=0), "steps=0"),
    (dict(batch_size=1.5), "batch_size=1.5"),
    (dict(seq_len=1), "seq_len=1"),
    (dict(lr=0), "lr=0"),
    (dict(gate_lr=float("nan")), "gate_lr=nan"),
    (dict(penalty=-1.0), "penalty=-1.0"),
    (dict(budget=0.0), "budget=0.0"),
    (dict(budget=1.5), "budget=1.5"),
    (dict(temperature=0), "temperature=0"),
    (dict(gate_init=1.0), "gate_init=1.0"),
    (dict(gate_unit="layer"), "gate_unit='layer'"),
    (dict(gdn_params="some"), "gdn_params='some'"),
    (dict(seed=-1), "seed=-1"),
    (dict(progress="yes"), "progress='yes'"),
])
def test_bad_configs_name_the_field_and_value(kw, match):
    with pytest.raises(ValueError, match=f"SelectorConfig.{match}"):
        SelectorConfig(**kw)


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match="unknown field"):
        SelectorConfig.from_dict({"steps": 3, "lambda": 1.0})


def test_gates_move_loss_falls_and_the_teacher_is_untouched(tiny_qwen3):
    before = {n: p.detach().clone() for n, p in tiny_qwen3.named_parameters()}
    grads = {n: p.requires_grad for n, p in tiny_qwen3.named_parameters()}
    r = train_selector(tiny_qwen3, batches(), cfg(steps=12, penalty=0.0))
    assert r.history[0]["mean_gate"] == pytest.approx(0.125)  # gate_init None: the gates start at the budget
    assert r.gates.shape == (3, 4) and not torch.allclose(r.gates, torch.full((3, 4), 0.125, dtype=torch.float64))
    losses = [h["loss"] for h in r.history]
    assert len(losses) == 12 and losses[-1] < 0.7 * losses[0]
    for n, p in tiny_qwen3.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.requires_grad == grads[n] and p.grad is None, n
    assert not tiny_qwen3.training  # left in eval mode, as it came


def test_a_strong_penalty_drives_the_gates_down(tiny_qwen3):
    free = train_selector(tiny_qwen3, batches(), cfg(penalty=0.0, gate_init=0.5))
    strong = train_selector(tiny_qwen3, batches(), cfg(penalty=100.0, budget=0.125, gate_init=0.5))
    assert free.gates.mean() > 0.5 > strong.gates.mean()
    assert strong.history[-1]["mean_gate"] < strong.history[0]["mean_gate"]


def test_same_seed_same_gates_another_seed_other_gates(tiny_qwen3):
    a = train_selector(tiny_qwen3, batches(), cfg(seed=1))
    b = train_selector(tiny_qwen3, batches(), cfg(seed=1))
    assert torch.equal(a.gates, b.gates) and a.history == b.history
    c = train_selector(tiny_qwen3, batches(), cfg(seed=1, gdn_params="all"))
    assert not torch.equal(a.gates, c.gates)  # the GDN q/k/v train too: other gates
    again = SelectorResult.from_dict(a.to_dict())
    assert torch.equal(again.gates, a.gates) and again.config == a.config


def test_kv_group_gates_are_shared_by_a_groups_heads(tiny_qwen3):
    r = train_selector(tiny_qwen3, batches(), cfg(gate_unit="kv_group"))
    g = r.gates.view(3, 2, 2)  # [L, K, H/K]
    assert torch.equal(g[..., 0], g[..., 1])


@pytest.mark.parametrize("unit, n_units, n_heads", [("head", 3, 3), ("kv_group", 2, 4)])
def test_the_mask_has_the_budget_and_says_learned(tiny_qwen3, unit, n_units, n_heads):
    gates = torch.tensor([[0.1, 0.2, 0.3, 0.9], [0.8, 0.1, 0.1, 0.1], [0.2, 0.2, 0.7, 0.6]])  # [L, H]
    r = SelectorResult(gates, cfg(), n_kv_heads=2, settings={"last": {"loss": 0.1}})
    mask = selector_mask(r, tiny_qwen3, fraction=0.25, unit=unit)  # 12 heads -> 3; 6 KV groups -> 2 (round 1.5)
    assert mask.settings["strategy"] == "learned" and mask.settings["ranked_by"] == "global"
    assert mask.settings["unit"] == unit and mask.settings["k"] == n_units and len(mask.fa_heads) == n_heads
    assert mask.settings["selector"]["steps"] == 8 and mask.settings["selector_result"]["last"] == {"loss": 0.1}
    got = sorted(h.to_list() for h in mask.fa_heads)
    if unit == "head":
        assert got == [[0, 3], [1, 0], [2, 2]]
    else:  # groups by mean gate: L2 group 1 (0.65), L0 group 1 (0.6)
        assert got == [[0, 2], [0, 3], [2, 2], [2, 3]]
    assert mask.scores is not None and mask.n_kv_heads == 2
    with pytest.raises(ValueError, match="ignores scores"):
        selector_mask(r, tiny_qwen3, fraction=0.25, strategy="random_global")


def test_a_gqa_llama_teacher_trains_with_biases_off(tmp_path):
    teacher = tiny_model("llama", num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                         hidden_size=48, head_dim=8)
    r = train_selector(teacher, batches(), cfg(steps=3, gate_unit="kv_group"), {"gdn_conv": True, "merge": "none"})
    assert r.gates.shape == (2, 6) and r.settings["hybrid"]["gdn_conv"] and len(r.history) == 3
    mask = selector_mask(r, teacher, k=1, unit="kv_group")
    assert len(mask.fa_heads) == 2


def test_the_gdn_branch_is_the_hybrids_and_gate_one_is_the_teacher(tiny_qwen3):
    """Gate 0 everywhere: the selector's layer is the all-GDN hybrid's attention (hybrid.from_mask, same gamma);
    gate 1: the teacher's attention output exactly (zero error)."""
    from headscope.arch import describe
    from headscope.mask import HeadMask
    from hybrid.convert import from_mask
    from research.studies.selector import HeadSelector, _capture

    sel = HeadSelector(tiny_qwen3, cfg(), {"seed": 4})
    ids = next(batches())  # [B, T]
    xs, z_fa = _capture(tiny_qwen3, ids)
    sel.calibrate(z_fa)
    hyb = from_mask(tiny_qwen3, HeadMask.for_model(tiny_qwen3, []), allow_degenerate=True, seed=4)
    T = ids.shape[1]
    pos = torch.arange(T)
    cos, sin = hyb.model.rotary_emb(pos, torch.float32)  # [T, D] each
    projs = describe(tiny_qwen3).out_projs
    with torch.no_grad():
        for l, layer in enumerate(hyb.model.layers):
            layer.self_attn.merge.gamma.copy_(sel.gamma[l])
            want = layer.self_attn(xs[l], pos, cos, sin)  # [B, T, C]
            got = projs[l](sel.gdn_heads(l, xs[l]).reshape(*ids.shape, -1))  # [B, T, C]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        sel.logits.fill_(60.0)  # every gate 1
        loss, terms = sel.loss(xs, z_fa, list(projs))
    assert terms["recon"] < 1e-12 and terms["mean_gate"] == pytest.approx(1.0)
