"""The fused GDN decode step (hybrid.ops.gdn_decode): the PyTorch twin equals the branch's split T = 1 step (float64,
both decay kinds, with and without q/k norm); the "fused" decode backend of whole tiny hybrids equals "split"
(logits, GDN states, greedy tokens); input errors; the Triton kernel vs the twin in Triton's CPU interpreter (a
subprocess with TRITON_INTERPRET=1, when Triton imports) and on the GPU in bf16 with its kernel count (marked gpu)."""
import textwrap

import pytest
import torch

from headscope.mask import HeadMask
from hybrid.cache import LayerCache
from hybrid.config import HybridConfig
from hybrid.convert import from_mask
from hybrid.decoding import Decoder, greedy_decode, prefill
from hybrid.layers.common import RotaryEmbedding
from hybrid.layers.hybrid_attention import GatedDeltaNetBranch, HybridAttention, use_fused_decode
from hybrid.ops.gdn_decode import gdn_decode_step, gdn_decode_step_reference, resolve_backend
from hybrid.ops.prologue import triton_available

from model_factories import tiny_model
from testing_utils import assert_close, compile_for_hopper, run_in_triton_interpreter

pytestmark = pytest.mark.usefixtures("one_thread")
FA = [(0, 1), (0, 2), (1, 0), (1, 3), (2, 2)]  # as tests/hybrid/test_decoding.py


def branch(decay, qk, D=16, H_L=3, seed=0):
    cfg = HybridConfig(hidden_size=4 * D, num_attention_heads=4, num_key_value_heads=2, head_dim=D, qk_norm=qk,
                       num_hidden_layers=1, fa_heads=[[0]], hybrid={"decay": decay})
    torch.manual_seed(seed)
    br = GatedDeltaNetBranch(cfg, [1, 2, 3][:H_L]).double().eval()
    with torch.no_grad():
        for p in br.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return br, cfg


def decay_params(br):
    return dict(A_log=br.A_log, dt_bias=br.dt_bias) if br.decay == "gdn" else dict(a_bias=br.a_bias)


@pytest.mark.parametrize("decay", ["gdn", "simple"])
@pytest.mark.parametrize("qk", [True, False])
@pytest.mark.parametrize("per_row_cos", [False, True])
@torch.no_grad()
def test_twin_equals_the_branch_split_step(decay, qk, per_row_cos):
    br, cfg = branch(decay, qk)
    B, H, D = 3, br.n_heads, br.head_dim
    x = torch.randn(B, 1, cfg.hidden_size, dtype=torch.float64)  # [B, 1, C]
    pos = torch.tensor([[4], [9], [0]]) if per_row_cos else torch.tensor([7])  # [B, 1] or [1]
    cos, sin = RotaryEmbedding(cfg)(pos, torch.float64)  # [B, 1, D] or [1, D]
    s0 = torch.randn(B, H, D, D, dtype=torch.float64)  # [B, H, D, D]
    cache = LayerCache(state=s0.clone())
    o_split = br(x, pos, cos, sin, cache)  # the split path: prologue, casts, gates, recurrence, set_state
    q, k, v = (p(x).view(B, 1, H, D) for p in (br.q_proj, br.k_proj, br.v_proj))  # [B, 1, H, D]
    state = s0.clone()
    ptr = state.data_ptr()
    o = gdn_decode_step(q, k, v, br.b_proj(x), br.a_proj(x), state, br.q_norm.weight if qk else None,
                        br.k_norm.weight if qk else None, cos, sin, eps=cfg.rms_norm_eps, norm=qk, decay=decay,
                        scale=D ** -0.5, **decay_params(br))  # CPU: the twin
    assert state.data_ptr() == ptr  # in place
    assert_close("o", o, o_split, "fp64_exact")
    assert_close("state", state, cache.state, "fp64_exact")
    assert not torch.equal(state, s0)


BUILDERS = {
    "head": lambda t: from_mask(t, HeadMask.for_model(t, FA)),  # decay gdn, q/k norm (qwen3)
    "head_conv_simple": lambda t: from_mask(t, HeadMask.for_model(t, FA), gdn_conv=True, decay="simple"),
    "head_fold": lambda t: from_mask(t, HeadMask.for_model(t, FA), gdn_fold_heads=True),
}


def perturbed(model):
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.new_parameters().values():  # off init, so gates, convs and decays matter
            p.add_(torch.randn_like(p) * 0.1)
    return model


def decode_steps(model, seqs, N, fused):
    cache, logits = prefill(model, [s[:-N] for s in seqs], N)
    dec = Decoder(model, cache, fused_gdn=fused)
    ptrs = [l.state.data_ptr() for l in cache.layers if l.state is not None]
    steps = [logits]
    for i in range(N - 1):
        steps.append(dec.step(torch.stack([s[len(s) - N + i] for s in seqs])[:, None]))  # [B, V]
    assert ptrs == [l.state.data_ptr() for l in cache.layers if l.state is not None]  # states kept their address
    return torch.stack(steps), [l.state.clone() for l in cache.layers if l.state is not None]


@pytest.mark.parametrize("name,family", [("head", "qwen3"), ("head_conv_simple", "qwen3"), ("head_fold", "qwen3"),
                                         ("head", "llama")])
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_decode_backend_equals_split_in_a_whole_model(name, family, rows):
    """Decoder steps with fused_gdn (the twin on the CPU) equal the split ops: logits and every GDN state (float64;
    llama has no q/k norm; one row takes the one-matmul projections of B * T == 1, and so does the fused op at any
    number of rows: its kernel reads the strided slices of the one matmul's output)."""
    teacher = tiny_model(family, dtype=torch.float64)
    model = perturbed(BUILDERS[name](teacher))
    torch.manual_seed(1)
    seqs = [torch.randint(0, 128, (n,)) for n in (9, 5, 12)[:rows]]
    calls = []
    import hybrid.ops.gdn_decode as gd

    real = gd.gdn_decode_step
    gd.gdn_decode_step = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        split, s_split = decode_steps(model, seqs, 4, fused=False)
        assert not calls
        fused, s_fused = decode_steps(model, seqs, 4, fused=True)
        assert len(calls) == 3 * 3  # 3 steps x 3 layers with GDN heads
        for layer in (m for m in model.modules() if isinstance(m, HybridAttention) and m.la is not None):
            # one matmul at every row count: both branches' projections together, or the GDN branch's own
            owner, name = (layer, "fa_la_in") if layer.fa is not None else (layer.la, "qkvba")
            assert name in owner.__dict__.get("_fused_linears", {}), (layer.layer_idx, name)
    finally:
        gd.gdn_decode_step = real
        use_fused_decode(model, False)
    assert_close("logits", fused, split, "fp64_exact")
    for a, b in zip(s_fused, s_split):
        assert_close("state", a, b, "fp64_exact")


def test_greedy_tokens_with_fused_equal_split_and_the_switch():
    teacher = tiny_model("qwen3")
    model = perturbed(BUILDERS["head"](teacher))
    torch.manual_seed(2)
    prompts = [torch.randint(0, 128, (n,)) for n in (7, 3)]
    split = greedy_decode(model, prompts, 8)  # [B, 8]
    assert use_fused_decode(model, True) == 3  # three layers have GDN heads
    assert {m.decode_backend for m in model.modules() if isinstance(m, GatedDeltaNetBranch)} == {"fused"}
    fused = greedy_decode(model, prompts, 8)
    assert torch.equal(fused, split)
    assert use_fused_decode(model, False) == 3
    assert torch.equal(greedy_decode(model, prompts, 8), split)


def test_errors_name_the_problem():
    B, H, D = 2, 3, 16
    q = torch.randn(B, 1, H, D)
    ba = torch.randn(B, 1, H)
    st = torch.zeros(B, H, D, D)
    cos = torch.ones(1, D)
    w = torch.ones(D)
    kw = dict(A_log=torch.zeros(H), dt_bias=torch.zeros(H))

    def call(q=q, k=None, v=None, b=ba, a=ba, state=st, cos=cos, **extra):
        args = dict(norm=True, **kw)
        args.update(extra)
        return gdn_decode_step(q, q if k is None else k, q if v is None else v, b, a, state, w, w, cos, cos, **args)

    with pytest.raises(ValueError, match=r"T == 1.*split path"):
        call(q=torch.randn(B, 2, H, D), cos=torch.ones(2, D))
    with pytest.raises(ValueError, match=r"state must be \[B, H, D, D\] = \[2, 3, 16, 16\].*allocate"):
        call(state=torch.zeros(B, H, D, 8))
    with pytest.raises(ValueError, match="state must be float32"):
        call(state=st.half())
    with pytest.raises(ValueError, match=r"b must be \[B, 1, H\]"):
        call(b=torch.randn(B, H))
    with pytest.raises(ValueError, match="cos/sin must be"):
        call(cos=torch.ones(3, D))
    with pytest.raises(ValueError, match="k and v must be"):
        call(v=torch.randn(B, 1, H, 8))
    with pytest.raises(ValueError, match="needs dt_bias"):
        call(dt_bias=None)
    with pytest.raises(ValueError, match="needs a_bias"):
        call(decay="simple")
    with pytest.raises(ValueError, match="decay must be one of"):
        call(decay="mamba")
    with pytest.raises(ValueError, match="backend must be one of"):
        call(backend="cuda")
    assert resolve_backend("auto", q) == "torch"  # CPU
    if triton_available():
        with pytest.raises(ValueError, match="power of two"):
            resolve_backend("triton", torch.randn(1, 1, 2, 24))
        with pytest.raises(ValueError, match="no backward"):
            resolve_backend("triton", q, needs_grad=True)
    else:
        with pytest.raises(ImportError, match="needs Triton"):
            call(backend="triton")
    br, _ = branch("gdn", True)
    br.decode_backend = "fast"
    with pytest.raises(ValueError, match="use_fused_decode"):
        br(torch.randn(1, 1, 64, dtype=torch.float64), torch.tensor([0]), torch.ones(1, 16, dtype=torch.float64),
           torch.zeros(1, 16, dtype=torch.float64), None)


INTERPRETED = textwrap.dedent("""
    import torch
    from hybrid.ops.gdn_decode import gdn_decode_step_reference, gdn_decode_step_triton
    from testing_utils import assert_close
    torch.manual_seed(0)
    for B, H, D, per_row, norm, decay in [(1, 3, 16, False, True, "gdn"), (3, 2, 64, True, True, "simple"),
                                          (2, 2, 128, True, False, "gdn"), (2, 1, 32, False, False, "simple")]:
        fused = torch.randn(B, 1, 3 * H * D + 2 * H)  # [B, 1, 3HD + 2H] one projection output, as fused_linear's
        q, k, v, ba = fused.split([H * D, H * D, H * D, 2 * H], -1)
        q, k, v = (t.view(B, 1, H, D) * 3 for t in (q, k, v))  # strided views ([B, 1, H, D])
        b, a = ba.split(H, -1)  # [B, 1, H] views
        a = a * 4  # softplus / logsigmoid over a wide range
        wq, wk = 1 + 0.2 * torch.randn(D), 1 + 0.2 * torch.randn(D)
        ang = torch.randn(B, 1, D // 2) * 5 if per_row else torch.randn(1, D // 2) * 5
        ang = torch.cat([ang, ang], -1)
        p = dict(A_log=torch.randn(H), dt_bias=torch.randn(H) * 3) if decay == "gdn" else dict(a_bias=torch.randn(H) * 3)
        s0 = torch.randn(B, H, D, D)
        states = [s0.clone(), s0.clone()]
        ptr = states[1].data_ptr()
        for step in range(3):
            outs = [fn(q, k, v, b, a, st, wq, wk, ang.cos(), ang.sin(), eps=1e-6, norm=norm, decay=decay, scale=0.3, **p)
                    for fn, st in zip((gdn_decode_step_reference, gdn_decode_step_triton), states)]
            assert outs[1].dtype == v.dtype and outs[1].shape == (B, 1, H, D)
            assert_close(f"B={B} D={D} {decay} norm={norm} o step {step}", outs[1], outs[0], "fp32")
            assert_close(f"B={B} D={D} {decay} norm={norm} state step {step}", states[1], states[0], "fp32")
        assert states[1].data_ptr() == ptr
""")


INTERPRETED_MODEL = textwrap.dedent("""
    import torch
    import hybrid.ops.gdn_decode as gd
    gd.resolve_backend = lambda backend, q, needs_grad=False: "triton"  # the fused kernel on CPU tensors
    from model_factories import tiny_model
    from testing_utils import assert_close
    from headscope.mask import HeadMask
    from hybrid.convert import from_mask
    from hybrid.decoding import prefill, Decoder
    teacher = tiny_model("qwen3")
    model = from_mask(teacher, HeadMask.for_model(teacher, [(0, 0), (0, 1), (1, 2), (2, 0)]), decay="simple")
    with torch.no_grad():
        for p in model.new_parameters().values():
            p.add_(torch.randn_like(p) * 0.1)
    torch.manual_seed(1)
    for lens in ((9,), (9, 5)):
        seqs = [torch.randint(0, 128, (n,)) for n in lens]
        res = []
        for fused in (False, True):
            cache, logits = prefill(model, [s[:-3] for s in seqs], 3)
            dec = Decoder(model, cache, fused_gdn=fused)
            steps = [logits] + [dec.step(torch.stack([s[len(s) - 3 + i] for s in seqs])[:, None]) for i in range(2)]
            res.append((torch.stack(steps), [l.state.clone() for l in cache.layers]))
        assert_close(f"rows={len(lens)} logits", res[1][0], res[0][0], "fp32")
        for a, b in zip(res[1][1], res[0][1]):
            assert_close(f"rows={len(lens)} state", a, b, "fp32")
    print("OK")
""")


@pytest.mark.skipif(not triton_available(), reason="Triton not importable (the GPU image has it)")
def test_triton_kernel_in_cpu_interpreter_matches_the_twin_alone_and_in_decoding():
    """The kernel vs the twin (float32, 3 steps, strided views, both decays, D = 16..128), then inside Decoder steps
    of a tiny hybrid (one and two rows) vs the split path; one interpreter subprocess (its start is most of the
    time)."""
    import os

    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_in_triton_interpreter(f"import sys; sys.path.append({tests!r})\n" + INTERPRETED + INTERPRETED_MODEL)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("decay", ["gdn", "simple"])
def test_gpu_bf16_kernel_matches_the_float32_twin(D, decay):
    """bf16 inputs, 8 steps: the kernel's o and state vs the twin run in float32 on the same bf16 inputs (upcast),
    within bf16_kernel (1e-2; the kernel computes in float32 too and rounds o to bf16 once, about 2e-3)."""
    from hybrid.ops.gdn_decode import gdn_decode_step_triton

    torch.manual_seed(D)
    B, H, dev = 3, 14, "cuda"
    wq, wk = (1 + 0.2 * torch.randn(D, device=dev)).bfloat16(), (1 + 0.2 * torch.randn(D, device=dev)).bfloat16()
    p = (dict(A_log=torch.rand(H, device=dev) * 2, dt_bias=torch.randn(H, device=dev) - 3) if decay == "gdn"
         else dict(a_bias=torch.randn(H, device=dev) + 3))
    s_ref = torch.zeros(B, H, D, D, device=dev)  # [B, H, D, D]
    s_got = s_ref.clone()
    for step in range(8):
        q, k, v = (torch.randn(B, 1, H, D, device=dev) * 2).bfloat16(), torch.randn(B, 1, H, D, device=dev).bfloat16(), \
            torch.randn(B, 1, H, D, device=dev).bfloat16()
        b, a = torch.randn(B, 1, H, device=dev).bfloat16(), torch.randn(B, 1, H, device=dev).bfloat16()
        ang = torch.randint(0, 50000, (B, 1, 1), device=dev).float() / (1e6 ** (torch.arange(0, D, 2, device=dev) / D))
        cos, sin = torch.cat([ang, ang], -1).cos().bfloat16(), torch.cat([ang, ang], -1).sin().bfloat16()
        ref = gdn_decode_step_reference(q.float(), k.float(), v.float(), b.float(), a.float(), s_ref, wq.float(),
                                        wk.float(), cos.float(), sin.float(), norm=True, decay=decay, **p)
        got = gdn_decode_step_triton(q, k, v, b, a, s_got, wq, wk, cos, sin, norm=True, decay=decay, **p)
        assert got.dtype == torch.bfloat16
        e_o = assert_close(f"D={D} {decay} o step {step}", got, ref, "bf16_kernel")
        e_s = assert_close(f"D={D} {decay} state step {step}", s_got, s_ref, "bf16_kernel")
    print(f"gdn decode D={D} {decay}: o {e_o:.2e}, state {e_s:.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
def test_gpu_fused_decode_has_fewer_kernels_per_layer_and_matches_split():
    """A bf16 tiny hybrid on CUDA: Decoder steps with fused_gdn (eager and CUDA graph) match the split step within
    bf16_model, and one step launches fewer kernels per layer (torch.profiler) with the fused op than without."""
    from research.perf.op_count import count_cuda_kernels

    teacher = tiny_model("qwen3", num_hidden_layers=2, head_dim=64).to("cuda", torch.bfloat16)
    fa = [(l, (l % 2) * 2 + r) for l in range(2) for r in range(2)]  # per layer one KV group FA, the rest GDN
    model = perturbed(from_mask(teacher, HeadMask.for_model(teacher, fa))).cuda()
    torch.manual_seed(5)
    seqs = [torch.randint(0, 128, (n,), device="cuda") for n in (40, 23)]
    for graph in (False, True):
        res = []
        for fused in (False, True):
            cache, logits = prefill(model, [s[:-5] for s in seqs], 5)
            dec = Decoder(model, cache, cuda_graph=graph, fused_gdn=fused)
            steps = [logits.clone()] + [dec.step(torch.stack([s[len(s) - 5 + i] for s in seqs])[:, None]).clone()
                                        for i in range(4)]
            res.append(torch.stack(steps).float())
        assert_close(f"graph={graph} fused vs split", res[1], res[0], "bf16_model")
    use_fused_decode(model, False)
    split = count_cuda_kernels(model, batch=1)
    use_fused_decode(model, True)
    fused = count_cuda_kernels(model, batch=1)
    use_fused_decode(model, False)
    print("kernels per layer: split", split["scoped_per_layer"], "fused", fused["scoped_per_layer"],
          "layer 0 fused", fused["scoped"].get("layer 0"))
    assert fused["scoped_per_layer"] < split["scoped_per_layer"]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
def test_gpu_kernel_with_programmatic_dependent_launch_gives_the_same_output_and_state():
    from hybrid.ops.gdn_decode import gdn_decode_step_triton
    from hybrid.ops.utils import dependent_launch

    torch.manual_seed(1)
    B, H, D, dev = 2, 14, 128, "cuda"
    wq, wk = (1 + 0.2 * torch.randn(D, device=dev)).bfloat16(), (1 + 0.2 * torch.randn(D, device=dev)).bfloat16()
    p = dict(A_log=torch.rand(H, device=dev) * 2, dt_bias=torch.randn(H, device=dev) - 3)
    q, k, v = (torch.randn(B, 1, H, D, device=dev).bfloat16() for _ in range(3))  # [B, 1, H, D] each
    b, a = torch.randn(B, 1, H, device=dev).bfloat16(), torch.randn(B, 1, H, device=dev).bfloat16()  # [B, 1, H]
    cos, sin = torch.ones(B, 1, D, device=dev).bfloat16(), torch.zeros(B, 1, D, device=dev).bfloat16()
    s0 = torch.randn(B, H, D, D, device=dev) * 0.1  # [B, H, D, D]
    s_want, s_got = s0.clone(), s0.clone()
    want = gdn_decode_step_triton(q, k, v, b, a, s_want, wq, wk, cos, sin, **p)
    with dependent_launch():
        got = gdn_decode_step_triton(q * 1.0, k, v, b, a, s_got, wq, wk, cos, sin, **p)  # a kernel right before
    assert torch.equal(got, want) and torch.equal(s_got, s_want)


@pytest.mark.skipif(not triton_available(), reason="Triton not importable (the GPU image has it)")
@pytest.mark.parametrize("gdc", [False, True])
def test_kernel_compiles_for_hopper_with_and_without_dependent_launch(gdc):
    import importlib

    _, step = importlib.import_module("hybrid.ops.gdn_decode")._kernel()
    types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "b_ptr", "a_ptr", "o_ptr", "qw_ptr", "kw_ptr", "cos_ptr",
                                  "sin_ptr")}
    types |= {"s_ptr": "*fp32", "p1_ptr": "*fp32", "p2_ptr": "*fp32", "eps": "fp32", "l2eps": "fp32", "scale": "fp32"}
    ptx = compile_for_hopper(step, types, {"D": 128, "BV": 32, "NORM": True, "GDN": True, "USE_GDC": gdc},
                             launch_pdl=gdc)
    assert (ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")) == (gdc, gdc)
