"""from_mask: parameter reuse (FA rows, GDN rows, GQA -> MHA expansion), mask handling, bad inputs."""
import pytest
import torch

from headscope.mask import HeadMask, MaskError
from hybrid.config import HybridConfigError
from hybrid.convert import from_mask

from model_factories import tiny_model

FA = [(0, 1), (1, 0), (1, 3), (2, 2)]


def rows(linear, heads, D=16):
    return torch.cat([linear.weight[h * D:(h + 1) * D] for h in heads])  # [h*D, C]


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_parameter_reuse(family):
    teacher = tiny_model(family)
    model = from_mask(teacher, HeadMask.for_model(teacher, FA))
    D, rep = model.config.head_dim, model.config.n_rep
    assert torch.equal(model.model.embed_tokens.weight, teacher.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, teacher.lm_head.weight)
    for l, (layer, t) in enumerate(zip(model.model.layers, teacher.model.layers)):
        attn, ta = layer.self_attn, t.self_attn
        fa = [h for (ll, h) in FA if ll == l]
        la = [h for h in range(4) if h not in fa]
        assert attn.fa.heads == fa and attn.la.heads == la
        assert torch.equal(attn.fa.q_proj.weight, rows(ta.q_proj, fa, D))
        kv = sorted({h // rep for h in fa})
        assert torch.equal(attn.fa.k_proj.weight, rows(ta.k_proj, kv, D))
        assert torch.equal(attn.fa.v_proj.weight, rows(ta.v_proj, kv, D))
        assert torch.equal(attn.la.q_proj.weight, rows(ta.q_proj, la, D))
        assert torch.equal(attn.la.k_proj.weight, rows(ta.k_proj, [h // rep for h in la], D))  # GQA -> MHA
        assert torch.equal(attn.la.v_proj.weight, rows(ta.v_proj, [h // rep for h in la], D))
        assert torch.equal(attn.o_proj.weight, ta.o_proj.weight)
        assert torch.equal(layer.mlp.down_proj.weight, t.mlp.down_proj.weight)
        assert torch.equal(layer.input_layernorm.weight, t.input_layernorm.weight)
        if family == "qwen2":  # q/k/v biases follow their rows
            assert torch.equal(attn.la.k_proj.bias, torch.cat([ta.k_proj.bias[h // rep * D:(h // rep + 1) * D] for h in la]))
        if family == "qwen3":
            assert torch.equal(attn.la.q_norm.weight, ta.q_norm.weight)
            assert torch.equal(attn.fa.k_norm.weight, ta.k_norm.weight)


def test_new_parameters_are_named_and_initialised():
    model = from_mask(tiny_model("qwen3"), HeadMask.for_model(tiny_model("qwen3"), FA), merge="gated_branch", gdn_conv=True)
    new = model.new_parameters()
    kinds = {n.split(".")[-2] if n.endswith((".weight", ".bias")) else n.split(".")[-1] for n in new}
    assert kinds == {"gate_proj", "b_proj", "a_proj", "A_log", "dt_bias", "gamma", "branch_gate",
                     "q_conv", "k_conv", "v_conv"}
    assert not set(new) & set(model.reused_parameters())
    assert not any(".mlp." in n for n in new)  # the teacher's MLP gate_proj is the teacher's
    assert all(getattr(p, "_hybrid_new", False) for p in new.values())  # marked where created
    fa = model.model.layers[1].self_attn.fa
    assert torch.equal(fa.gate_proj.weight, torch.zeros_like(fa.gate_proj.weight))
    la = model.model.layers[1].self_attn.la
    assert (la.A_log.exp() >= 1).all() and (la.A_log.exp() <= 16).all()
    per_head = from_mask(tiny_model("qwen3"), HeadMask.for_model(tiny_model("qwen3"), FA), merge="gated_head")
    assert {n for n in per_head.new_parameters() if "head_gate" in n} == {
        f"model.layers.{l}.self_attn.merge.head_gate.{w}" for l in range(3) for w in ("weight", "bias")}


def test_mask_from_json_path(tmp_path):
    teacher = tiny_model("qwen3")
    path = tmp_path / "mask.json"
    HeadMask.for_model(teacher, FA).to_json(path)
    model = from_mask(teacher, path)
    assert model.config.fa_heads == [[1], [0, 3], [2]]


def test_mask_for_another_model_shape():
    other = tiny_model("qwen3", num_hidden_layers=2)
    with pytest.raises(MaskError, match="3 layers x 4 heads"):
        from_mask(other, HeadMask.for_model(tiny_model("qwen3"), FA))


def test_fingerprint_mismatch_can_be_overridden():
    teacher = tiny_model("qwen3")
    mask = HeadMask.for_model(tiny_model("qwen3", intermediate_size=96), FA)
    with pytest.raises(MaskError, match="fingerprint"):
        from_mask(teacher, mask)
    assert from_mask(teacher, mask, check_fingerprint=False).config.fa_heads[1] == [0, 3]


@pytest.mark.parametrize("heads,kw,match", [
    ([], {}, "no full-attention head"),
    ([(l, h) for l in range(3) for h in range(4)], {}, "every head"),
    ([(0, 1)], {"require_fa_per_layer": True}, "no full-attention head"),
    (FA, {"merge": "mean"}, "merge"),
    (FA, {"windw": 3}, "windw"),
])
def test_bad_masks_and_options(heads, kw, match):
    teacher = tiny_model("qwen3")
    with pytest.raises((HybridConfigError, MaskError), match=match):
        from_mask(teacher, HeadMask.for_model(teacher, heads), **kw)


def test_unsupported_teacher_and_mask_type():
    gpt2 = tiny_model("gpt2")
    with pytest.raises(HybridConfigError, match="Llama-shaped"):
        from_mask(gpt2, HeadMask.for_model(gpt2, [(0, 0)]))
    with pytest.raises(TypeError, match="HeadMask"):
        from_mask(tiny_model("qwen3"), [(0, 1)])


def test_irregular_fa_subset_uses_per_head_kv():
    teacher = tiny_model("qwen3")
    model = from_mask(teacher, HeadMask.for_model(teacher, [(0, 0), (0, 1), (0, 2)]))  # KV 0 twice, KV 1 once
    fa = model.model.layers[0].self_attn.fa
    assert fa.kv_heads == [0, 1] and not fa.gqa
    assert model.model.layers[1].self_attn.fa is None  # a layer with no FA head: GDN only
    logits = model(torch.randint(0, 128, (1, 7))).logits
    assert logits.shape == (1, 7, 128) and torch.isfinite(logits).all()


@pytest.mark.parametrize("options", [dict(merge="gated_branch", gdn_conv=True), dict(merge="gated_head"),
                                     dict(decay="simple"),
                                     dict(granularity="token")])
def test_new_parameters_have_one_initialisation(options, tmp_path):
    """A bare HybridForCausalLM(config) (``_init_weights``) and from_mask give the new parameters the same
    values (``reset_new_parameters``), and a saved model reloads them (marks included), not re-initialised."""
    from hybrid import HybridForCausalLM

    teacher = tiny_model("qwen3")
    built = from_mask(teacher, HeadMask.for_model(teacher, FA), **options)
    bare = HybridForCausalLM(built.config)
    new = built.new_parameters()
    assert set(bare.new_parameters()) == set(new) and new
    for name, p in new.items():
        assert torch.equal(bare.get_parameter(name), p), name
    with torch.no_grad():
        for p in new.values():
            p.add_(0.5)
    built.save_pretrained(tmp_path)
    loaded = HybridForCausalLM.from_pretrained(tmp_path)
    assert set(loaded.new_parameters()) == set(new)
    for name, p in new.items():
        assert torch.equal(loaded.get_parameter(name), p), name


def test_rope_mean_rotation_is_the_mean_over_causal_pairs():
    from hybrid.convert import rope_mean_rotation

    inv_freq = torch.tensor([1.0, 0.1, 1e-4])  # [D/2]
    c, s = rope_mean_rotation(inv_freq, 5)
    pairs = [(m - n) for m in range(5) for n in range(m + 1)]  # every causal (query, key) distance
    for i, w in enumerate(inv_freq.double()):
        assert c[i] == pytest.approx(sum(torch.cos(d * w) for d in pairs).item() / len(pairs))
        assert s[i] == pytest.approx(sum(torch.sin(d * w) for d in pairs).item() / len(pairs))
    assert rope_mean_rotation(inv_freq, 1) == (pytest.approx(torch.ones(3).double()), pytest.approx(torch.zeros(3).double()))
    assert c[2] == pytest.approx(1.0, abs=1e-6)  # a wavelength far past the context: the rows are kept


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: the query bias is mapped too
@torch.no_grad()
def test_rope_mean_queries_give_the_teachers_rope_logit_averaged_over_causal_pairs(family):
    from hybrid.layers.common import apply_rope

    teacher = tiny_model(family)
    L = 12
    model = from_mask(teacher, HeadMask.for_model(teacher, FA), fa_nope_init="rope_mean", fa_nope_init_length=L)
    copy = from_mask(teacher, HeadMask.for_model(teacher, FA))
    layer, ref = model.model.layers[1].self_attn.fa, copy.model.layers[1].self_attn.fa
    assert torch.equal(layer.k_proj.weight, ref.k_proj.weight)  # keys as the teacher's
    x = torch.randn(2, model.config.hidden_size, dtype=torch.float64)  # [2, C]: one query input, one key input
    D = model.config.head_dim
    q0 = ref.q_proj.double()(x[:1]).view(1, 1, -1, D)  # [1, 1, H_fa, D]: the teacher's query (RoPE-trained)
    k = ref.k_proj.double()(x[1:]).view(1, 1, -1, D)[:, :, :1]  # [1, 1, 1, D]: the first FA head's key
    q1 = layer.q_proj.double()(x[:1]).view(1, 1, -1, D)  # [1, 1, H_fa, D]: the mapped query
    cos, sin = model.model.rotary_emb(torch.arange(L), torch.float64)  # [L, D] each
    logits = [(apply_rope(q0, cos[m:m + 1], sin[m:m + 1])[..., 0, :] *
               apply_rope(k, cos[n:n + 1], sin[n:n + 1])[..., 0, :]).sum() for m in range(L) for n in range(m + 1)]
    mean_rope_logit = torch.stack(logits).mean()
    assert (q1[..., 0, :] * k[..., 0, :]).sum().item() == pytest.approx(mean_rope_logit.item(), rel=1e-5)  # float32 rows
    assert not torch.equal(layer.q_proj.weight, ref.q_proj.weight)


def test_rope_mean_is_refused_with_rope_and_with_query_norms():
    teacher = tiny_model("llama")
    with pytest.raises(HybridConfigError, match="fa_rope=True"):
        from_mask(teacher, HeadMask.for_model(teacher, FA), fa_rope=True, fa_nope_init="rope_mean")
    with pytest.raises(HybridConfigError, match="fa_nope_init"):
        from_mask(teacher, HeadMask.for_model(teacher, FA), fa_nope_init="zero")
    qwen3 = tiny_model("qwen3")
    with pytest.raises(ValueError, match="q/k norms"):
        from_mask(qwen3, HeadMask.for_model(qwen3, FA), fa_nope_init="rope_mean")
