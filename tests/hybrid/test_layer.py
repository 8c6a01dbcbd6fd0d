"""One hybrid layer: FA branch vs the teacher's heads without RoPE, GDN branch vs the op, merge variants."""
import pytest
import torch
import torch.nn.functional as F

from headscope.mask import HeadMask
from hybrid.convert import from_mask
from hybrid.layers.common import apply_rope, log_length_scale
from hybrid.layers.merge import MERGES, calibrate_merge
from hybrid.ops import recurrent_gated_delta_rule

from model_factories import tiny_model
from testing_utils import assert_close

FA = [(0, 1), (1, 0), (1, 3), (2, 2)]
D = 16


def build(**kw):
    teacher = tiny_model("qwen3", dtype=torch.float64)
    return teacher, from_mask(teacher, HeadMask.for_model(teacher, FA), **kw)


def heads(linear, idx, x):
    return torch.stack([F.linear(x, linear.weight[h * D:(h + 1) * D]) for h in idx], dim=2)  # [B, T, h, D]


def teacher_nope_heads(ta, x, q_heads, scale_q=None):
    """The teacher's attention output of q_heads with RoPE removed, computed by hand."""
    rep = 2
    q = ta.q_norm(heads(ta.q_proj, q_heads, x))  # [B, T, h, D]
    k = ta.k_norm(heads(ta.k_proj, [h // rep for h in q_heads], x))
    v = heads(ta.v_proj, [h // rep for h in q_heads], x)
    if scale_q is not None:
        q = q * scale_q[None, :, None, None]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2)  # [B, T, h, D]


@pytest.mark.parametrize("log_scale", [False, True])
def test_fa_branch_is_teacher_heads_without_rope(log_scale):
    teacher, model = build(fa_log_scale=log_scale, log_scale_base=4.0)
    x = torch.randn(2, 9, 64, dtype=torch.float64)  # [B, T, C]
    pos = torch.arange(9)
    cos, sin = model.model.rotary_emb(pos, x.dtype)
    fa = model.model.layers[1].self_attn.fa
    o = fa(x, pos, cos, sin, None)  # [B, T, 2, D], gate = 1 at init
    s = log_length_scale(pos, 4.0).double() if log_scale else None
    assert_close("fa branch", o, teacher_nope_heads(teacher.model.layers[1].self_attn, x, [0, 3], s), "fp64_exact")


def test_partial_rope_keeps_the_fast_frequencies_and_leaves_the_slow_ones_unrotated():
    """rope_kept_frequencies counts the wavelengths 2*pi/theta within the limit (None: all); apply_rope with
    partial_rope_tables rotates those dims as apply_rope does and passes the rest through; all kept is apply_rope
    itself."""
    from hybrid.layers.common import partial_rope_tables, rope_kept_frequencies

    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float) / D))  # [D/2] fastest first
    waves = 2 * torch.pi / inv_freq
    assert rope_kept_frequencies(inv_freq, None) == D // 2
    assert rope_kept_frequencies(inv_freq, float(waves[2])) == 3 and rope_kept_frequencies(inv_freq, 1.0) == 0
    with pytest.raises(ValueError, match="decreasing order"):
        rope_kept_frequencies(inv_freq.flip(0), 100.0)
    x = torch.randn(2, 5, 3, D, dtype=torch.float64)  # [B, T, H, D]
    freqs = torch.arange(5, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()  # [T, D] each
    full, part = apply_rope(x, cos, sin), apply_rope(x, *partial_rope_tables(cos, sin, 3))
    on = (torch.arange(D) % (D // 2)) < 3  # [D]
    assert torch.equal(part[..., on], full[..., on]) and torch.equal(part[..., ~on], x[..., ~on])
    assert torch.equal(apply_rope(x, *partial_rope_tables(cos, sin, D // 2)), full)


@pytest.mark.parametrize("log_scale", [False, True])
def test_fa_branch_with_partial_rope_spans_nope_to_rope(log_scale):
    """fa_rope_max_wavelength below every wavelength gives the NoPE branch, above every one the RoPE branch."""
    x = torch.randn(2, 9, 64, dtype=torch.float64)  # [B, T, C]
    pos = torch.arange(9)
    out = {}
    for name, kw in {"nope": dict(fa_rope=False), "rope": dict(fa_rope=True),
                     "none_kept": dict(fa_rope=True, fa_rope_max_wavelength=1.0),
                     "all_kept": dict(fa_rope=True, fa_rope_max_wavelength=1e12)}.items():
        _, model = build(fa_log_scale=log_scale, log_scale_base=4.0, **kw)
        cos, sin = model.model.rotary_emb(pos, x.dtype)
        out[name] = model.model.layers[1].self_attn.fa(x, pos, cos, sin, None)  # [B, T, 2, D]
    assert torch.equal(out["none_kept"], out["nope"]) and torch.equal(out["all_kept"], out["rope"])
    assert not torch.equal(out["nope"], out["rope"])


def test_partial_rope_needs_rope_and_a_positive_wavelength():
    from hybrid.config import HybridConfigError, HybridOptions

    assert HybridOptions(fa_rope=True, fa_rope_max_wavelength=8192).fa_rope_max_wavelength == 8192
    with pytest.raises(HybridConfigError, match="needs fa_rope=True"):
        HybridOptions(fa_rope=False, fa_rope_max_wavelength=8192)
    for bad in (0, -1.0, True, "8192"):
        with pytest.raises(HybridConfigError, match="positive number of positions"):
            HybridOptions(fa_rope=True, fa_rope_max_wavelength=bad)


def test_log_length_scale_formula():
    s = log_length_scale(torch.arange(3), 512.0)
    assert torch.allclose(s, torch.log(torch.tensor([1.0, 2.0, 3.0]) + 512) / torch.log(torch.tensor(512.0)))


def test_gdn_branch_matches_the_op():
    teacher, model = build()
    ta, la = teacher.model.layers[1].self_attn, model.model.layers[1].self_attn.la
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    pos = torch.arange(9)
    cos, sin = model.model.rotary_emb(pos, x.dtype)
    q = apply_rope(ta.q_norm(heads(ta.q_proj, [1, 2], x)), cos, sin)
    k = apply_rope(ta.k_norm(heads(ta.k_proj, [0, 1], x)), cos, sin)  # KV head of q-head 1 is 0, of 2 is 1
    v = heads(ta.v_proj, [0, 1], x)
    g = (-la.A_log.exp() * F.softplus(la.dt_bias)).expand(2, 9, 2)  # a_proj = 0 at init
    beta = torch.full((2, 9, 2), 0.5, dtype=x.dtype)
    ref, _ = recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert_close("gdn branch", la(x, pos, cos, sin, None), ref, "fp64_exact")


def test_short_conv_starts_as_identity():
    _, a = build()
    _, b = build(gdn_conv=True)
    ids = torch.randint(0, 128, (1, 10))
    assert_close("conv at init", b(ids).logits, a(ids).logits, "fp64_exact")


def test_merge_variants():
    _, norm = build()
    _, none = build(merge="none")
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    o_fa, o_la = torch.randn(2, 5, 2, D, dtype=torch.float64) * 3, torch.randn(2, 5, 2, D, dtype=torch.float64) * 20
    fn = norm.model.layers[1].self_attn.merge  # FA heads 0, 3; GDN heads 1, 2
    with torch.no_grad():
        fn.gamma.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    z = fn(x, o_fa, o_la).view(2, 5, 4, D)
    assert torch.allclose(z.pow(2).mean(-1).sqrt(), torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=z.dtype).expand(2, 5, 4), atol=1e-5)
    z = none.model.layers[1].self_attn.merge(x, o_fa, o_la).view(2, 5, 4, D)
    assert torch.equal(z[:, :, [0, 3]], o_fa) and torch.equal(z[:, :, [1, 2]], o_la)  # original head order
    zn = fn(x, o_fa, o_la).view(2, 5, 4, D)
    for mode in ("gated_head", "gated_branch"):
        fg = build(merge=mode)[1].model.layers[1].self_attn.merge
        with torch.no_grad():
            fg.gamma.copy_(fn.gamma)
        assert_close(f"{mode} at init == norm", fg(x, o_fa, o_la), fn(x, o_fa, o_la), "fp64_exact")
    # gated_branch: one scale per branch, shared by its heads: FA heads up, GDN heads down together
    fb = build(merge="gated_branch")[1].model.layers[1].self_attn.merge
    with torch.no_grad():
        fb.gamma.copy_(fn.gamma)
        fb.branch_gate.bias.copy_(torch.tensor([2.0, -2.0]))
    ratio = fb(x, o_fa, o_la).view(2, 5, 4, D).norm(dim=-1) / zn.norm(dim=-1)  # [B, T, H] scale per head
    a_fa = 2 * torch.sigmoid(torch.tensor(4.0, dtype=torch.float64))  # 2 softmax([2, -2])[0]
    assert_close("FA heads", ratio[..., [0, 3]], a_fa.expand(2, 5, 2), "fp64_exact")
    assert_close("GDN heads", ratio[..., [1, 2]], (2 - a_fa).expand(2, 5, 2), "fp64_exact")


def test_gated_head_merge_is_a_per_head_competition():
    """gated_head: a = H softmax(W x + b) over all heads of both branches, head h scaled by a_h (float64)."""
    _, norm = build()
    _, gh = build(merge="gated_head")
    fn, fg = norm.model.layers[1].self_attn.merge, gh.model.layers[1].self_attn.merge
    assert fg.head_gate.out_features == 4 and not hasattr(fg, "branch_gate")
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    o_fa, o_la = torch.randn(2, 5, 2, D, dtype=torch.float64) * 3, torch.randn(2, 5, 2, D, dtype=torch.float64) * 20
    with torch.no_grad():
        fg.head_gate.weight.normal_()
        fg.head_gate.bias.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    a = 4 * torch.softmax(x @ fg.head_gate.weight.T + fg.head_gate.bias, dim=-1)  # [B, T, H] by hand
    expected = fn(x, o_fa, o_la).view(2, 5, 4, D) * a[..., None]
    assert_close("gated_head", fg(x, o_fa, o_la).view(2, 5, 4, D), expected, "fp64_exact")
    # two heads of the SAME branch (FA heads 0 and 3) get different scales: the competition is per head
    assert not torch.allclose(a[..., 0], a[..., 3])


def test_merge_registry_one_entry_is_a_new_mode():
    """A new merge mode is one MergeMode entry: the model builds with it and the fast path equals the reference."""
    from hybrid.layers.merge import MergeMode, register_merge

    def gate(merge, hidden):
        return torch.nn.Linear(hidden, merge.n_heads)

    def scales(merge, x):  # [B, T, H]: an independent sigmoid per head (no competition), 1 at init
        return 2 * torch.sigmoid(merge.sigmoid_gate(x))

    mode = MergeMode("sigmoid_head_test", "per-head sigmoid gate (test entry)", gate_name="sigmoid_gate", gate=gate,
                      scales=scales)
    register_merge(mode)
    try:
        _, model = build(merge="sigmoid_head_test")
        fu, o_proj = model.model.layers[1].self_attn.merge, model.model.layers[1].self_attn.o_proj
        with torch.no_grad():
            fu.sigmoid_gate.weight.normal_()
        assert "model.layers.1.self_attn.merge.sigmoid_gate.weight" in dict(model.named_parameters())
        x, o_fa, o_la = (torch.randn(1, 4, *s, dtype=torch.float64) for s in ((64,), (2, D), (2, D)))
        fu.project_min_tokens = 0
        assert_close("new mode: project", fu.project(x, o_fa, o_la, o_proj), o_proj(fu(x, o_fa, o_la)), "fp64_exact")
        with pytest.raises(ValueError, match="already registered in hybrid.layers.merge.MERGES: pass overwrite=True"):
            register_merge(mode)
        norm = MERGES["norm"]
        with pytest.raises(ValueError, match="'norm' is already registered"):  # a built-in: never replaced silently
            register_merge(MergeMode("norm", "mine", norm=False))
        assert MERGES["norm"] is norm
    finally:
        MERGES.unregister("sigmoid_head_test")


@pytest.mark.parametrize("bad, match", [("gated", "gated_head.*gated_branch"), ("softmax", "must be one of")])
def test_unknown_or_renamed_merge_is_refused(bad, match):
    from hybrid.config import HybridConfigError, HybridOptions

    with pytest.raises(HybridConfigError, match=match):
        HybridOptions(merge=bad)


def test_token_level_refuses_a_gated_merge():
    from hybrid.config import HybridConfigError, HybridOptions

    with pytest.raises(HybridConfigError, match="token-level baseline supports"):
        HybridOptions(granularity="token", merge="gated_head")


def test_calibrate_merge_sets_gamma_to_teacher_head_rms():
    teacher, model = build()
    ids = torch.randint(0, 128, (2, 11))
    seen = {}
    h = teacher.model.layers[2].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("z", a[0]))
    try:
        teacher(ids)
    finally:
        h.remove()
    expected = seen["z"].view(2, 11, 4, D).pow(2).mean(dim=(0, 1, 3)).sqrt()  # [H]
    gamma = calibrate_merge(model, teacher, ids)
    assert gamma.shape == (3, 4)
    assert_close("gamma", model.model.layers[2].self_attn.merge.gamma, expected, "fp64_exact")


def test_calibrate_merge_sets_both_gammas_of_the_token_level_baseline():
    """The token-level baseline's heads sum two normalised branches: each gets the teacher head's RMS; its
    merge='none' has no gamma to set and is refused."""
    from hybrid.builders import from_token_level

    teacher, _ = build()
    ids = torch.randint(0, 128, (2, 11))
    model = from_token_level(teacher, window=4)
    gamma = calibrate_merge(model, teacher, ids)  # [L, H]
    for l, layer in enumerate(model.model.layers):
        assert_close("swa_gamma", layer.self_attn.swa_gamma, gamma[l], "fp64_exact")
        assert_close("gdn_gamma", layer.self_attn.gdn_gamma, gamma[l], "fp64_exact")
    assert not torch.allclose(gamma, torch.ones_like(gamma))
    with pytest.raises(ValueError, match="no gamma"):
        calibrate_merge(from_token_level(teacher, window=4, merge="none"), teacher, ids)


@pytest.mark.parametrize("merge", sorted(MERGES))
def test_merge_project_equals_o_proj_of_the_merged_heads(merge):
    """The layer's fast path (no [B, T, H*D] buffer, gamma folded into o_proj's columns) computes
    o_proj(merge(...)) exactly (float64), values and gradients, for every merge mode."""
    _, model = build(merge=merge)
    attn = model.model.layers[1].self_attn  # FA heads 0, 3; GDN heads 1, 2
    fu = attn.merge
    fu.project_min_tokens = 0  # the fast path at any size (the default keeps short calls on the buffer path)
    with torch.no_grad():
        if fu.gamma is not None:
            fu.gamma.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        if fu.gate_name is not None:  # off init, so the gate's scales differ per head and position
            getattr(fu, fu.gate_name).weight.normal_()
        attn.o_proj.weight.normal_()
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    o_fa = (torch.randn(2, 5, 2, D, dtype=torch.float64) * 3).requires_grad_()
    o_la = (torch.randn(2, 5, 2, D, dtype=torch.float64) * 20).requires_grad_()
    params = [p for p in (fu.gamma, attn.o_proj.weight) if p is not None]
    ref = attn.o_proj(fu(x, o_fa, o_la))  # [B, T, C]
    fast = fu.project(x, o_fa, o_la, attn.o_proj)  # [B, T, C]
    assert_close("project", fast, ref, "fp64_exact")
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(fast, [o_fa, o_la, *params], g),
                    torch.autograd.grad(ref, [o_fa, o_la, *params], g)):
        assert_close("project grad", a, b, "fp64_exact")


def test_merge_project_keeps_o_proj_hooks_working():
    """With a hook on o_proj (an intervention on its input z) the layer falls back to o_proj(z): the hook runs."""
    _, model = build()
    attn = model.model.layers[1].self_attn
    attn.merge.project_min_tokens = 0
    seen = []
    handle = attn.o_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    try:
        model(torch.randint(0, 128, (1, 6)))
    finally:
        handle.remove()
    assert seen == [torch.Size([1, 6, 4 * D])]


def test_whole_model_is_the_same_on_both_merge_paths():
    """Logits with every layer on the fast merge path equal the buffer path (float64)."""
    _, model = build()
    ids = torch.randint(0, 128, (2, 9))
    ref = model(ids).logits  # [B, T, V] short call: buffer path
    for layer in model.model.layers:
        layer.self_attn.merge.project_min_tokens = 0
    assert_close("logits, fast merge path", model(ids).logits, ref, "fp64_exact")


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["norm", "gated_head", "gated_branch"])
def test_merge_project_bf16_on_gpu_matches_float32(merge):
    """Both merge paths in bf16 on the GPU (16 x 128 heads, 16K tokens, 2 FA heads) against float32 on the
    same inputs: output and the gradients of the branch outputs, gamma and o_proj's weight."""
    import copy

    from hybrid.layers.merge import HeadMerge

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    H, Dh, C, T = 16, 128, 2048, 16384
    fu32 = HeadMerge(C, H, Dh, [3, 12], merge).cuda()
    with torch.no_grad():
        fu32.gamma.uniform_(0.5, 2.0)
        if fu32.gate_name is not None:
            getattr(fu32, fu32.gate_name).weight.normal_(std=0.02)
    o32 = torch.nn.Linear(H * Dh, C, bias=False).cuda()
    x = torch.randn(1, T, C, device="cuda")  # [B, T, C]
    o_fa = torch.randn(1, T, 2, Dh, device="cuda") * 3  # [B, T, H_F, D]
    o_la = torch.randn(1, T, H - 2, Dh, device="cuda") * 20  # [B, T, H_L, D]
    g = torch.randn(1, T, C, device="cuda")  # [B, T, C]

    def run(fu, o, dtype, fast):
        fu.project_min_tokens = 0 if fast else 1 << 62
        a, b = (t.to(dtype).requires_grad_() for t in (o_fa, o_la))
        out = fu.project(x.to(dtype), a, b, o)  # [B, T, C]
        grads = torch.autograd.grad(out, [a, b, fu.gamma, o.weight], g.to(dtype))
        return [out.float()] + [t.float() for t in grads]

    ref = run(fu32, o32, torch.float32, fast=False)
    for fast in (False, True):
        fu16, o16 = copy.deepcopy(fu32).to(torch.bfloat16), copy.deepcopy(o32).to(torch.bfloat16)
        for name, got, want in zip(("out", "d_o_fa", "d_o_la", "d_gamma", "d_W"), run(fu16, o16, torch.bfloat16, fast), ref):
            assert_close(f"{name} fast={fast}", got, want, "bf16_model")


def test_gdn_fold_heads_option_gives_the_same_model_output():
    teacher, model = build()
    _, folded = build(gdn_fold_heads=True)
    assert folded.config.options.gdn_fold_heads and folded.model.layers[1].self_attn.la.fold_heads
    ids = torch.randint(0, teacher.config.vocab_size, (2, 11))  # [B, T]
    assert_close("fold_heads logits", folded(ids).logits, model(ids).logits, "fp64_exact")



@pytest.mark.parametrize("cached", [False, True])
def test_hybrid_layer_traces_as_one_graph_without_host_sync(cached):
    """A layer with FA and GDN heads is one torch.compile graph (dynamo's explain, no inductor): the FA branch takes
    the query offset from the cache as a Python int, not int(positions[0]) (a device->host sync in every FA layer
    of every forward and a graph break under compile: a "compiled" stage-2 step once measured this way)."""
    import torch._dynamo as dynamo

    from hybrid.cache import LayerCache

    _, model = build(fa_log_scale=True)
    layer = model.model.layers[1]  # FA heads 0 and 3, GDN heads 1 and 2
    assert layer.self_attn.fa is not None and layer.self_attn.la is not None
    x = torch.randn(2, 9, 64, dtype=torch.float64)  # [B, T, C]
    pos = torch.arange(9)
    cos, sin = model.model.rotary_emb(pos, x.dtype)
    dynamo.reset()
    explained = dynamo.explain(layer)(x, pos, cos, sin, LayerCache() if cached else None)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_head_index_is_not_cached_from_inside_a_compiled_graph():
    """index_on caches one index tensor per (heads, device) in eager mode; inside torch.compile it makes the tensor
    in the graph instead: a cached graph output is what a CUDA graph (compile mode "reduce-overhead") overwrites on
    its next replay ("accessing tensor output of CUDAGraphs that has been overwritten", seen on the H200)."""
    from hybrid.layers import common

    heads = (5, 1, 3)
    key = (heads, "cpu")
    common._INDEX_CACHE.pop(key, None)
    x = torch.arange(12.0).reshape(2, 6)  # [B, H]
    torch._dynamo.reset()
    got = torch.compile(lambda t: t.index_select(-1, common.index_on(heads, t.device)), backend="eager")(x)  # [B, 3]
    assert key not in common._INDEX_CACHE
    assert torch.equal(got, x[:, [5, 1, 3]])
    eager = common.index_on(heads, x.device)  # eager calls still cache
    assert common._INDEX_CACHE[key] is eager and eager.tolist() == [5, 1, 3]


def test_take_heads_equals_index_select_in_every_form():
    """common.take_heads: runs of consecutive heads (repeats start a run) give index_select's values, a view for
    one run, one cat for a few, index_select itself past MAX_SLICE_RUNS."""
    from hybrid.layers.common import MAX_SLICE_RUNS, head_runs, take_heads

    assert head_runs((0, 1, 2, 6, 7)) == ((0, 3), (6, 8)) and head_runs((0, 0, 1)) == ((0, 1), (0, 2))
    x = torch.randn(2, 3, 10, 4)  # [B, T, H, D]
    for heads in [(3, 4, 5), (0, 1, 2, 6, 7, 8), (0, 0, 1), (9,), (0, 2, 4, 6, 8), tuple(range(10))[::-1]]:
        got = take_heads(x, 2, heads)  # [B, T, h, D]
        assert torch.equal(got, x.index_select(2, torch.tensor(heads))), heads
        assert torch.equal(take_heads(x[0, 0, :, 0], -1, heads), x[0, 0, list(heads), 0])
        if len(head_runs(heads)) == 1:
            assert got.data_ptr() == x[:, :, heads[0]].data_ptr()  # a view, no copy
    assert len(head_runs((0, 2, 4, 6, 8))) > MAX_SLICE_RUNS


@pytest.mark.parametrize("merge", ["norm", "gated_branch"])
@pytest.mark.parametrize("fast", [False, True])
def test_a_compiled_hybrid_layer_has_no_head_index_tensor_in_its_graph(merge, fast):
    """No index tensor is made inside a compiled hybrid layer (FA heads 0, 1, 3 of 4: not one run per KV head;
    both merge paths): such a tensor is a device constant of the graph, which AOTAutograd's cache cannot
    serialize on CUDA ("unable to serialize compiled graph ... aten._to_copy(tensor([...], device='cuda:0',
    size=(24,), dtype=torch.uint8)", seen on the H200), so every run that resumed compiled those layers again."""
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = from_mask(teacher, HeadMask.for_model(teacher, [(0, 0), (0, 1), (0, 3)]), merge=merge)
    layer = model.model.layers[0]
    assert not layer.self_attn.fa.gqa and layer.self_attn.la is not None
    layer.self_attn.merge.project_min_tokens = 0 if fast else 1 << 62
    x = torch.randn(2, 9, 64, dtype=torch.float64)  # [B, T, C]
    pos = torch.arange(9)
    cos, sin = model.model.rotary_emb(pos, x.dtype)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(layer, backend=capture)(x, pos, cos, sin, None)  # [B, T, C]
    assert_close("compiled layer", got, layer(x, pos, cos, sin, None), "fp64_exact")
    made = [n.format_node() for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and n.target in (torch.tensor, torch.as_tensor)]
    assert len(graphs) == 1 and made == []


@pytest.mark.parametrize("rep", [1, 3])
def test_grouped_attention_in_query_chunks_equals_one_call(monkeypatch, rep):
    """A long prefill goes to SDPA in query chunks (the head-expanded mask stays bounded); each query row's output
    is the one-call output, for GQA (3 query heads per KV head) and one KV copy per head, ragged rows included."""
    from hybrid.layers import common

    torch.manual_seed(0)
    B, T, K, D = 2, 37, 2, 8
    q = torch.randn(B, T, K * rep, D)  # [B, T, H, D]
    k, v = torch.randn(B, T, K, D), torch.randn(B, T, K, D)  # [B, S, K, D]
    lengths = torch.tensor([T, 25])
    pos = torch.arange(T)
    mask = (pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] < lengths[:, None, None])  # [B, T, S]
    mask |= torch.eye(T, dtype=torch.bool)[None]  # every query sees its own key
    whole = common.grouped_attention(q, k, v, mask, D ** -0.5)  # [B, T, H, D]
    calls = []
    real = common._grouped_attention
    monkeypatch.setattr(common, "_grouped_attention", lambda *a: calls.append(a[0].shape[1]) or real(*a))
    monkeypatch.setattr(common, "GROUPED_MASK_ELEMENTS", B * rep * T * 5)  # 5 query rows per call
    chunked = common.grouped_attention(q, k, v, mask, D ** -0.5)
    assert calls == [5] * 7 + [2]
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    calls.clear()
    common.grouped_attention(q[:, :1], k, v, mask[:, :1], D ** -0.5)  # one token per row: one call
    assert calls == [1]


@pytest.mark.gpu
def test_grouped_attention_8k_prefill_of_32_rows_stays_small_on_cuda():
    """The fidelity suite's float32 8K prefill of 32 rows (SmolLM2's 9 query / 3 KV heads of 64): in query chunks
    it needs a few GiB above its inputs, where one call built a 6.4 GB boolean mask and SDPA a 25.7 GB float copy;
    the rows equal one call on a slice small enough to make in one piece."""
    from hybrid.layers import common

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    dev, B, T, H, K, D = "cuda", 32, 8192, 9, 3, 64
    q = torch.randn(B, T, H, D, device=dev)  # [B, T, H, D]
    k, v = torch.randn(B, T, K, D, device=dev), torch.randn(B, T, K, D, device=dev)  # [B, S, K, D]
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None].expand(B, T, T)  # [B, T, S]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    o = common.grouped_attention(q, k, v, mask, D ** -0.5)  # [B, T, H, D]
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - before) / 2**30
    assert o.shape == (B, T, H, D) and torch.isfinite(o).all()
    assert extra < 8.0, f"{extra:.1f} GiB above the inputs"
    rows = slice(T - 64, T)  # the last 64 query rows of two sequences, one call
    one = common._grouped_attention(q[:2, rows], k[:2], v[:2], mask[:2, rows], D ** -0.5)  # [2, 64, H, D]
    torch.testing.assert_close(o[:2, rows], one, rtol=2e-5, atol=2e-5)
