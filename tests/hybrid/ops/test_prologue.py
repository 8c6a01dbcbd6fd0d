"""GDN prologue (q/k RMSNorm + RoPE + l2norm): the reference twin vs the branch's former unfused path (float64,
values and gradients), input checks and dispatch; the Triton kernel vs the twin in Triton's CPU interpreter when
Triton is importable (a subprocess with TRITON_INTERPRET=1), and on the GPU (marked gpu) in bf16."""
import textwrap

import pytest
import torch

from hybrid.config import HybridConfig
from hybrid.layers.common import RotaryEmbedding, apply_rope
from hybrid.layers.hybrid_attention import GatedDeltaNetBranch, qk_norm
from hybrid.ops import gated_delta_rule
from hybrid.ops.prologue import gdn_qk_prologue, prologue_reference, resolve_backend, triton_available

from testing_utils import assert_close, run_in_triton_interpreter


def branch_and_inputs(D=16, H_L=3, T=11, B=2, qk=True, seed=0):
    cfg = HybridConfig(hidden_size=4 * D, num_attention_heads=4, num_key_value_heads=2, head_dim=D, qk_norm=qk,
                       num_hidden_layers=1, fa_heads=[[0]], hybrid={"gdn_backend": "torch_chunk"})
    torch.manual_seed(seed)
    br = GatedDeltaNetBranch(cfg, [1, 2, 3][:H_L]).double()
    with torch.no_grad():
        for p in br.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    x = torch.randn(B, T, 4 * D, dtype=torch.float64, requires_grad=True)  # [B, T, C]
    pos = torch.arange(T)
    cos, sin = RotaryEmbedding(cfg)(pos, torch.float64)  # [T, D]
    return br, x, pos, cos, sin


def unfused_branch(br, x, cos, sin):
    """The GDN branch as it was before the prologue op: qk_norm, apply_rope, l2norm inside the kernel."""
    B, T, _ = x.shape
    H, D = br.n_heads, br.head_dim
    q, k, v = (p(x).view(B, T, H, D) for p in (br.q_proj, br.k_proj, br.v_proj))  # [B, T, H, D]
    if br.q_norm is not None:
        q, k = qk_norm(br.q_norm, q), qk_norm(br.k_norm, k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    beta = torch.sigmoid(br.b_proj(x))  # [B, T, H]
    o, _ = gated_delta_rule(q, k, v, br.log_decay(x), beta, scale=D ** -0.5, use_qk_l2norm_in_kernel=True,
                            backend="torch_chunk")
    return o  # [B, T, H, D]


@pytest.mark.parametrize("qk", [True, False])
def test_reference_prologue_branch_equals_unfused_path_with_gradients(qk):
    br, x, pos, cos, sin = branch_and_inputs(qk=qk)
    params = [p for p in br.parameters()]
    ref = unfused_branch(br, x, cos, sin)
    got = br(x, pos, cos, sin, None)
    assert_close("branch output", got, ref, "fp64_exact")
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), [x] + params, allow_unused=True)
    g_got = torch.autograd.grad((got * w).sum(), [x] + params, allow_unused=True)
    names = ["x"] + [n for n, _ in br.named_parameters()]
    for name, a, b in zip(names, g_got, g_ref):
        if b is None:
            assert a is None, name
            continue
        assert_close(f"d{name}", a, b, "fp64_exact")


def test_per_row_cos_equals_shared_cos():
    torch.manual_seed(0)
    q, k = torch.randn(2, 5, 3, 8, dtype=torch.float64), torch.randn(2, 5, 3, 8, dtype=torch.float64)
    w = torch.rand(8, dtype=torch.float64) + 0.5
    ang = torch.randn(5, 4, dtype=torch.float64)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # [T, D]
    a = gdn_qk_prologue(q, k, w, w, cos, sin)
    b = gdn_qk_prologue(q, k, w, w, cos.expand(2, 5, 8), sin.expand(2, 5, 8))
    for x, y in zip(a, b):
        assert_close("per-row cos", x, y, "fp64_exact")
    assert torch.allclose(a[0].norm(dim=-1), torch.ones(2, 5, 3, dtype=torch.float64))  # l2-normalised


def test_prologue_input_errors():
    q = torch.randn(1, 4, 2, 8)
    cos = torch.ones(4, 8)
    with pytest.raises(ValueError, match="must both be"):
        gdn_qk_prologue(q, q[..., :4], None, None, cos, cos, norm=False)
    with pytest.raises(ValueError, match="cos/sin must be"):
        gdn_qk_prologue(q, q, None, None, torch.ones(5, 8), torch.ones(5, 8), norm=False)
    with pytest.raises(ValueError, match="q_weight and k_weight"):
        gdn_qk_prologue(q, q, None, None, cos, cos, norm=True)
    with pytest.raises(ValueError, match="prologue backend must be one of"):
        gdn_qk_prologue(q, q, None, None, cos, cos, norm=False, backend="cuda")
    assert resolve_backend("auto", q) == "torch"  # CPU
    if not triton_available():
        with pytest.raises(ImportError, match="needs Triton"):
            gdn_qk_prologue(q, q, None, None, cos, cos, norm=False, backend="triton")
    else:
        with pytest.raises(ValueError, match="power of two"):
            resolve_backend("triton", torch.randn(1, 4, 2, 12))


def test_hybrid_option_validates_prologue_backend():
    from hybrid.config import HybridConfigError, HybridOptions

    with pytest.raises(HybridConfigError, match="prologue_backend"):
        HybridOptions(prologue_backend="fused")


INTERPRETED = textwrap.dedent("""
    import torch
    from hybrid.ops.prologue import prologue_reference, prologue_triton
    from testing_utils import assert_close, run_in_triton_interpreter
    torch.manual_seed(0)
    for D, per_row, norm in [(16, False, True), (64, True, True), (128, False, False)]:
        B, T, H = 2, 5, 3
        q = torch.randn(B, T, H, D, requires_grad=True)
        k = torch.randn(B, T, H, D, requires_grad=True)
        wq = (1 + 0.1 * torch.randn(D)).requires_grad_()
        wk = (1 + 0.1 * torch.randn(D)).requires_grad_()
        ang = torch.randn(B, T, D // 2) if per_row else torch.randn(T, D // 2)
        ang = torch.cat([ang, ang], -1)
        gq, gk = torch.randn(B, T, H, D), torch.randn(B, T, H, D)
        res = []
        for fn in (prologue_reference, prologue_triton):
            yq, yk = fn(q, k, wq, wk, ang.cos(), ang.sin(), 1e-6, norm)
            wrt = (q, k, wq, wk) if norm else (q, k)
            res.append((yq, yk) + torch.autograd.grad((yq * gq).sum() + (yk * gk).sum(), wrt))
        for name, a, b in zip(["q", "k", "dq", "dk", "dwq", "dwk"], res[1], res[0]):
            assert_close(f"D={D} {name}", a, b, "fp32")
    print("OK")
""")


@pytest.mark.skipif(not triton_available(), reason="Triton not importable (the GPU image has it)")
def test_triton_kernel_in_cpu_interpreter_matches_reference():
    run_in_triton_interpreter(INTERPRETED)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("per_row", [False, True])
def test_triton_prologue_bf16_matches_float32_reference(D, per_row):
    """The fused kernel in bf16 vs the reference twin in float32 on the same bf16 inputs: outputs and the
    gradients of q, k and both norm weights within bf16_kernel (1e-2)."""
    from hybrid.ops.prologue import prologue_triton

    torch.manual_seed(D)
    B, T, H = 2, 1000, 14
    dev = "cuda"
    q, k = (torch.randn(B, T, H, D, device=dev) * 3).bfloat16(), torch.randn(B, T, H, D, device=dev).bfloat16()
    wq, wk = (1 + 0.2 * torch.randn(D, device=dev)).bfloat16(), (1 + 0.2 * torch.randn(D, device=dev)).bfloat16()
    pos = torch.randint(0, 100000, (B, T), device=dev) if per_row else torch.arange(T, device=dev) * 97
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
    ang = pos.float()[..., None] * inv
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def run(fn, dtype):
        xs = [t.to(dtype).requires_grad_(True) for t in (q, k, wq, wk)]
        yq, yk = fn(*xs, cos.to(dtype), sin.to(dtype), 1e-6, True)
        grads = torch.autograd.grad((yq.float() * gq.float()).sum() + (yk.float() * gk.float()).sum(), xs)
        return (yq, yk) + grads

    ref = run(prologue_reference, torch.float32)
    got = run(prologue_triton, torch.bfloat16)
    for name, a, b in zip(["q", "k", "dq", "dk", "dwq", "dwk"], got, ref):
        err = assert_close(f"D={D} per_row={per_row} {name}", a, b, "bf16_kernel")
        print(f"prologue D={D} per_row={per_row} {name}: {err:.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
def test_triton_prologue_offsets_past_2_31_elements():
    """B * T * H * D past 2**31 (batch 8 at 128K tokens x 16 heads x 128 is 2.1e9): int64 row offsets, forward
    and backward; checked on the last tokens against the reference."""
    from hybrid.ops.prologue import prologue_triton

    B, T, H, D = 1, 1_100_000, 16, 128
    assert B * T * H * D > 2 ** 31
    dev = "cuda"
    torch.manual_seed(1)
    q = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16).requires_grad_(True)  # [B, T, H, D] 4.5 GB
    w = (1 + 0.2 * torch.randn(D, device=dev)).bfloat16()  # [D]
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
    ang = torch.arange(T, device=dev).float()[:, None] * inv
    ang = torch.cat([ang, ang], -1)  # [T, D]
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    yq, _ = prologue_triton(q, q[:, :1].detach(), w, w, cos, sin, 1e-6, True)  # [B, T, H, D]
    (gq,) = torch.autograd.grad(yq[:, -64:].float().sum(), q)  # [B, T, H, D]
    tail = q[:, -64:].detach().float().requires_grad_(True)  # [B, 64, H, D]
    ref, _ = prologue_reference(tail, tail[:, :1], w.float(), w.float(), cos[-64:].float(), sin[-64:].float(), 1e-6,
                                True)
    (gref,) = torch.autograd.grad(ref.sum(), tail)
    assert_close("last tokens", yq[:, -64:], ref, "bf16_kernel")
    assert_close("last tokens' grad", gq[:, -64:], gref, "bf16_kernel")
    assert gq[:, :-64].abs().max() == 0
