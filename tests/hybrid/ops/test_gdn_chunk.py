"""The PyTorch chunked gated delta rule against its naive recurrent twin, float64: outputs, states, gradients."""
import pytest
import torch
import torch.nn.functional as F

from hybrid.ops import recurrent_gated_delta_rule, torch_chunk_gated_delta_rule

from testing_utils import assert_close


def gdn_inputs(B, T, H, Dk, Dv, seed=0, l2norm=False):
    gen = torch.Generator().manual_seed(seed)
    x = dict(
        q=torch.randn(B, T, H, Dk, generator=gen, dtype=torch.float64),  # [B, T, H, Dk]
        k=torch.randn(B, T, H, Dk, generator=gen, dtype=torch.float64),  # [B, T, H, Dk]
        v=torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64),  # [B, T, H, Dv]
        g=F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64)) / 4,  # [B, T, H]
        beta=torch.rand(B, T, H, generator=gen, dtype=torch.float64),  # [B, T, H]
        initial_state=torch.randn(B, H, Dk, Dv, generator=gen, dtype=torch.float64),  # [B, H, Dk, Dv]
    )
    if not l2norm:  # keep the delta rule contractive (beta ||k||^2 < 2) when the kernel does not normalise
        x["k"] = F.normalize(x["k"], dim=-1)
    return x


def run(fn, x, with_h0, l2norm, chunk_size=64):
    """Outputs, final state and the gradients of a random linear loss w.r.t. every input."""
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if with_h0 or n != "initial_state"}
    o, s = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=0.3,
              initial_state=leaves.get("initial_state"), output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
              chunk_size=chunk_size)
    gen = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + \
        (s * torch.randn(s.shape, generator=gen, dtype=s.dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return o, s, dict(zip(leaves, grads))


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("with_h0,l2norm", [(True, False), (False, True)])
def test_chunk_matches_recurrent_with_gradients(T, with_h0, l2norm):
    x = gdn_inputs(B=2, T=T, H=2, Dk=12, Dv=8, l2norm=l2norm)  # Dk != Dv
    o, s, grads = run(torch_chunk_gated_delta_rule, x, with_h0, l2norm)
    o_ref, s_ref, grads_ref = run(recurrent_gated_delta_rule, x, with_h0, l2norm)
    assert_close("o", o, o_ref, "fp64_exact")
    assert_close("final_state", s, s_ref, "fp64_exact")
    for name in grads_ref:
        assert_close(f"d{name}", grads[name], grads_ref[name], "fp64_exact")
    assert set(grads) == ({"q", "k", "v", "g", "beta", "initial_state"} if with_h0 else {"q", "k", "v", "g", "beta"})


@pytest.mark.parametrize("chunk_size", [1, 16, 50])
def test_chunk_size_does_not_change_the_function(chunk_size):
    x = gdn_inputs(B=1, T=70, H=2, Dk=6, Dv=10)
    o, s, _ = run(torch_chunk_gated_delta_rule, x, True, False, chunk_size=chunk_size)
    o_ref, s_ref, _ = run(torch_chunk_gated_delta_rule, x, True, False, chunk_size=64)
    assert_close("o", o, o_ref, "fp64_exact")
    assert_close("final_state", s, s_ref, "fp64_exact")


@pytest.mark.parametrize("split", [1, 64, 97])
def test_split_with_state_carry_equals_one_pass(split):
    """What the decode cache relies on: prefix pass, then the rest from the prefix's final state."""
    x = gdn_inputs(B=2, T=150, H=2, Dk=8, Dv=8)
    args = dict(scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    names = ("q", "k", "v", "g", "beta")
    o_full, s_full = torch_chunk_gated_delta_rule(*(x[n] for n in names), initial_state=x["initial_state"], **args)
    o1, s1 = torch_chunk_gated_delta_rule(*(x[n][:, :split] for n in names), initial_state=x["initial_state"], **args)
    o2, s2 = torch_chunk_gated_delta_rule(*(x[n][:, split:] for n in names), initial_state=s1, **args)
    assert_close("o", torch.cat([o1, o2], 1), o_full, "fp64_exact")
    assert_close("final_state", s2, s_full, "fp64_exact")


def test_strong_decay_stays_finite():
    """Large |g| within a chunk must not overflow exp(G_i - G_j) in the masked (j > i) half."""
    x = gdn_inputs(B=1, T=128, H=1, Dk=4, Dv=4)
    x["g"] = torch.full_like(x["g"], -12.0)  # exp(12 * 63) overflows float64 if masked after exp
    o, s, grads = run(torch_chunk_gated_delta_rule, x, True, False)
    o_ref, s_ref, grads_ref = run(recurrent_gated_delta_rule, x, True, False)
    assert_close("o", o, o_ref, "fp64_exact")
    for name in grads_ref:  # dg ~ exp(-12) is what is left of O(1) terms that cancel in the chunk form
        assert_close(f"d{name}", grads[name], grads_ref[name], "fp64_cancellation" if name == "g" else "fp64_exact")


def test_float32_inputs_give_float32_state_and_input_dtype_output():
    x = {n: t.float() for n, t in gdn_inputs(B=1, T=40, H=2, Dk=8, Dv=8).items()}
    o, s = torch_chunk_gated_delta_rule(x["q"], x["k"], x["v"].bfloat16(), x["g"], x["beta"],
                                        initial_state=x["initial_state"], output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_ref, s_ref = recurrent_gated_delta_rule(x["q"], x["k"], x["v"].bfloat16(), x["g"], x["beta"],
                                              initial_state=x["initial_state"], output_final_state=True)
    assert_close("final_state fp32", s, s_ref, "fp32")
    with pytest.raises(ValueError, match="chunk_size"):
        torch_chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=0)
