"""gated_delta_rule dispatch on CPU, and the plumbing of the Hopper fallback (fla replaced by the torch twin)."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hybrid.ops.gdn as gdn
from hybrid.ops import (chunk_gated_delta_rule, gated_delta_rule, recurrent_gated_delta_rule,
                        torch_chunk_gated_delta_rule)

from testing_utils import assert_close


def gdn_inputs(B=1, T=20, H=2, Dk=8, Dv=6, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    x = [torch.randn(B, T, H, Dk, generator=gen, dtype=torch.float64),  # q [B, T, H, Dk]
         F.normalize(torch.randn(B, T, H, Dk, generator=gen, dtype=torch.float64), dim=-1),  # k [B, T, H, Dk]
         torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64),  # v [B, T, H, Dv]
         F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64)),  # g [B, T, H]
         torch.rand(B, T, H, generator=gen, dtype=torch.float64),  # beta [B, T, H]
         torch.randn(B, H, Dk, Dv, generator=gen, dtype=torch.float64)]  # h0 [B, H, Dk, Dv]
    return [t.requires_grad_(requires_grad) for t in x]


@pytest.mark.parametrize("backend", ["auto", "torch_chunk", "torch_recurrent"])
def test_cpu_backends_compute_the_same_function(backend):
    q, k, v, g, beta, h0 = gdn_inputs()
    o, s = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=backend)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close("o", o, o_ref, "fp64_exact")
    assert_close("final_state", s, s_ref, "fp64_exact")
    o2, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)  # CPU: the torch chunked twin
    assert_close("chunk_gated_delta_rule", o2, o_ref, "fp64_exact")


def test_auto_resolution_on_cpu():
    q = torch.zeros(1, 1, 1, 4)
    assert gdn.resolve_backend("auto", q, needs_grad=False) == "torch_recurrent"
    assert gdn.resolve_backend("auto", torch.zeros(1, 5, 1, 4), needs_grad=True) == "torch_chunk"


def test_bad_backend_and_fla_on_cpu_raise():
    q, k, v, g, beta, _ = gdn_inputs()
    with pytest.raises(ValueError, match="backend must be one of"):
        gated_delta_rule(q, k, v, g, beta, backend="triton")
    for name in ("fla_chunk", "fla_recurrent"):
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            gated_delta_rule(q, k, v, g, beta, backend=name)


@pytest.mark.parametrize("bwd_mode", ["fallback", "unguarded"])
def test_hopper_forward_fla_backward_recompute_plumbing(monkeypatch, bwd_mode):
    """On Hopper + Triton < 3.7.1, fla_chunk runs fla's forward and a recomputed backward. Here fla is replaced by
    the recurrent twin and the guard is faked, so the gradients must equal the twin's exactly."""
    calls = {"bypass": 0}

    def fake_fla(q, k, v, g, beta, scale, h0, out_state, l2, chunk_size):
        return recurrent_gated_delta_rule(q, k, v, g, beta, scale, h0, out_state, l2, chunk_size)

    class FakeBypass:
        def __enter__(self):
            calls["bypass"] += 1

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(gdn, "_fla_chunk_raw", fake_fla)
    monkeypatch.setattr(gdn, "hopper_backward_guarded", lambda: True)
    monkeypatch.setattr(gdn, "fla_hopper_guard_bypassed", FakeBypass)
    monkeypatch.delenv(gdn.HOPPER_BWD_ENV, raising=False)
    x = gdn_inputs(T=70, requires_grad=True)
    o, s = gdn.fla_chunk_gated_delta_rule(*x[:5], initial_state=x[5], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True,
                                          allow_unverified_hopper_backward=bwd_mode == "unguarded")
    loss = (o * o.detach().sin()).sum() + (s * s.detach().cos()).sum()
    grads = torch.autograd.grad(loss, x)
    o_ref, s_ref = torch_chunk_gated_delta_rule(*x[:5], initial_state=x[5], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    grads_ref = torch.autograd.grad((o_ref * o_ref.detach().sin()).sum() + (s_ref * s_ref.detach().cos()).sum(), x)
    assert_close("o", o, o_ref, "fp64_exact")
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads, grads_ref):
        assert_close(f"d{name}", a, b, "fp64_exact")
    assert calls["bypass"] == (1 if bwd_mode == "unguarded" else 0)


def test_hopper_verified_dims_bypass_the_guard_without_opt_in(monkeypatch):
    """A (Dk, Dv) listed as verified runs fla's backward (guard off) by default; other dims fall back to torch."""
    calls = {"bypass": 0}

    class FakeBypass:
        def __enter__(self):
            calls["bypass"] += 1

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(gdn, "_fla_chunk_raw", torch_chunk_gated_delta_rule)
    monkeypatch.setattr(gdn, "hopper_backward_guarded", lambda: True)
    monkeypatch.setattr(gdn, "fla_hopper_guard_bypassed", FakeBypass)
    monkeypatch.setattr(gdn, "HOPPER_BWD_VERIFIED_DIMS", frozenset({(8, 6)}))
    monkeypatch.delenv(gdn.HOPPER_BWD_ENV, raising=False)
    for Dv, expected in ((6, 1), (4, 1)):  # verified dims: one bypassed backward; unverified: none added
        x = gdn_inputs(Dv=Dv, requires_grad=True)
        o, _ = gdn.fla_chunk_gated_delta_rule(*x[:5])
        o.sum().backward()
        assert calls["bypass"] == expected and x[0].grad is not None


def test_parity_helpers_run_on_cpu_with_torch_backends():
    """The GPU parity helpers, pointed at the torch twins on CPU: the plumbing works and the errors are bf16-sized."""
    from hybrid.ops import parity

    errs = parity.gdn_chunk_parity(B=1, T=70, H=2, D=16, backend="torch_chunk", device="cpu")
    assert set(errs) == {"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
    assert max(errs.values()) <= 1e-2  # same function on the same bf16 values; only output rounding differs
    errs = parity.gdn_recurrent_parity(B=1, T=3, H=2, D=16, backend="torch_recurrent", device="cpu")
    assert set(errs) == {"o", "ht"} and max(errs.values()) <= 1e-2
    assert parity.environment()["cuda_available"] == str(torch.cuda.is_available())


def test_importing_ops_loads_no_optional_kernel_library():
    import subprocess

    code = ("import sys, hybrid.ops; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('fla', 'flash_attn', 'triton', 'transformer_lens', 'nnsight', 'plotly')]; assert not bad, bad")
    root = str(Path(__file__).resolve().parents[3])
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


@pytest.mark.parametrize("backend", ["torch_chunk", "torch_recurrent"])
def test_fold_heads_is_the_same_function_with_gradients(backend):
    """fold_heads runs [B*H, T, 1, D] (one fla tuning for every head count); values and gradients unchanged."""
    ref_in = gdn_inputs(B=2, H=3, requires_grad=True)
    fold_in = [t.detach().clone().requires_grad_(True) for t in ref_in]
    o_ref, s_ref = gated_delta_rule(*ref_in[:5], initial_state=ref_in[5], output_final_state=True, backend=backend)
    o, s = gated_delta_rule(*fold_in[:5], initial_state=fold_in[5], output_final_state=True, backend=backend,
                            fold_heads=True)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert_close("o folded", o, o_ref, "fp64_exact")
    assert_close("final_state folded", s, s_ref, "fp64_exact")
    (o_ref.square().sum() + s_ref.sum()).backward()
    (o.square().sum() + s.sum()).backward()
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], fold_in, ref_in):
        assert_close(f"d{name} folded", a.grad, b.grad, "fp64_exact")


def test_fold_heads_reaches_the_kernel_with_one_head(monkeypatch):
    """The backend sees H = 1 (what fla's autotuning keys on), whatever the layer's head count."""
    seen = []

    def spy(q, *args):
        seen.append(tuple(q.shape))
        return torch_chunk_gated_delta_rule(q, *args)

    monkeypatch.setattr(gdn, "torch_chunk_gated_delta_rule", spy)
    for H in (2, 3):
        q, k, v, g, beta, h0 = gdn_inputs(B=2, H=H)
        gated_delta_rule(q, k, v, g, beta, initial_state=h0, backend="torch_chunk", fold_heads=True)
    assert [s[2] for s in seen] == [1, 1] and [s[0] for s in seen] == [4, 6]


def test_fast_kernels_are_opaque_to_torch_compile():
    """dynamo never traces the fla / Triton / flash-attn Python (on the H200 it spent > 100 s in fla's and Triton's
    code for one batch shape and did not finish the call). The entry points with a backward (fla's chunk kernel,
    the Triton prologue's autograd Function, flash-attn) are torch.compiler.disable'd: a compiled hybrid layer
    breaks its graph there. The forward-only kernels of decoding (fla's recurrent step, the prologue's forward, the
    decode attention, the fused GDN step) are torch.library custom ops, opaque without a break
    (tests/hybrid/ops/test_custom_ops.py). The PyTorch twins stay traceable (CPU compile fuses them)."""
    from hybrid.ops.attention import attention_flash, attention_sdpa
    from hybrid.ops.gdn import chunk_gated_delta_rule, fla_chunk_gated_delta_rule, fla_recurrent_gated_delta_rule
    from hybrid.ops.prologue import prologue_reference, prologue_triton
    import hybrid.ops.gdn_decode  # noqa: F401  (registers hybrid::gdn_decode_step)

    for fn in (fla_chunk_gated_delta_rule, prologue_triton, attention_flash):
        assert getattr(fn, "_torchdynamo_disable", False), fn.__name__
    for fn in (chunk_gated_delta_rule, prologue_reference, attention_sdpa, fla_recurrent_gated_delta_rule):
        assert not getattr(fn, "_torchdynamo_disable", False), fn.__name__
    for op in ("decode_attention", "gdn_qk_prologue", "fla_recurrent_gated_delta_rule", "gdn_decode_step"):
        assert isinstance(getattr(torch.ops.hybrid, op).default, torch._ops.OpOverload), op
