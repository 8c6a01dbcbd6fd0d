"""The naive gated-delta-rule twin: fla's convention, checked against an independent per-head matrix form."""
import pytest
import torch
import torch.nn.functional as F

from hybrid.ops import recurrent_gated_delta_rule

from testing_utils import assert_close


def gdn_inputs(B=2, T=7, H=3, Dk=5, Dv=4, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, Dk, generator=gen, dtype=dtype)  # [B, T, H, Dk]
    k = F.normalize(torch.randn(B, T, H, Dk, generator=gen, dtype=dtype), dim=-1)  # [B, T, H, Dk]
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=dtype)  # [B, T, H, Dv]
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype))  # [B, T, H]
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)  # [B, T, H]
    h0 = torch.randn(B, H, Dk, Dv, generator=gen, dtype=dtype)  # [B, H, Dk, Dv]
    return q, k, v, g, beta, h0


def householder_reference(q, k, v, g, beta, h0, scale):
    """S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale S_t^T q_t, per (b, h)."""
    B, T, H, Dk = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)  # [B, T, H, Dv]
    S = h0.clone()  # [B, H, Dk, Dv]
    eye = torch.eye(Dk, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            s = S[b, h]  # [Dk, Dv]
            for t in range(T):
                kt, bt = k[b, t, h], beta[b, t, h]
                s = g[b, t, h].exp() * (eye - bt * torch.outer(kt, kt)) @ s + bt * torch.outer(kt, v[b, t, h])
                o[b, t, h] = scale * s.T @ q[b, t, h]
            S[b, h] = s
    return o, S


@pytest.mark.parametrize("l2norm", [False, True])
def test_recurrent_matches_householder_form(l2norm):
    q, k, v, g, beta, h0 = gdn_inputs()
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2norm)
    if l2norm:  # fla's in-kernel l2norm: x / sqrt(sum x^2 + 1e-6)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    o_ref, s_ref = householder_reference(q, k, v, g, beta, h0, scale=0.7)
    assert_close("o", o, o_ref, "fp64_exact")
    assert_close("final_state", s, s_ref, "fp64_exact")


def test_recurrent_defaults_and_dtypes():
    q, k, v, g, beta, _ = gdn_inputs(dtype=torch.float32)
    o, s = recurrent_gated_delta_rule(q, k, v.to(torch.bfloat16), g, beta)
    assert o.shape == (2, 7, 3, 4) and o.dtype == torch.bfloat16 and s is None
    o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta, scale=5 ** -0.5, output_final_state=True)
    assert s2.dtype == torch.float32 and s2.shape == (2, 3, 5, 4)
    o3, _ = recurrent_gated_delta_rule(q, k, v, g, beta)  # default scale is Dk ** -0.5
    assert_close("default scale", o3, o2, 0.0)


def test_decode_steps_equal_one_pass():
    q, k, v, g, beta, h0 = gdn_inputs(T=6)
    o_full, s_full = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    state, outs = h0, []
    for t in range(6):  # T = 1 decode steps, carrying the state
        o_t, state = recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                beta[:, t:t + 1], initial_state=state, output_final_state=True)
        outs.append(o_t)
    assert_close("o decode", torch.cat(outs, 1), o_full, "fp64_exact")
    assert_close("state decode", state, s_full, "fp64_exact")


def test_bad_shapes_raise_clear_errors():
    q, k, v, g, beta, h0 = gdn_inputs()
    with pytest.raises(ValueError, match="v shape"):
        recurrent_gated_delta_rule(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match="beta must have 3 dims"):
        recurrent_gated_delta_rule(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="initial_state shape"):
        recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0.transpose(-1, -2))
    with pytest.raises(ValueError, match="k shape"):
        recurrent_gated_delta_rule(q, k[..., :2], v, g, beta)
