"""Naive gated delta rule: a plain loop over positions (the reference twin and the decode step).

fla's convention (fla/ops/gated_delta_rule/naive.py), per head, state S [Dk, Dv]:
    S   <- exp(g_t) * S                       decay first
    u_t  = beta_t * (v_t - S^T k_t)           delta-rule correction against the decayed state
    S   <- S + k_t u_t^T                      write
    o_t  = S^T (scale * q_t)                  read after the write
with optional l2norm of q and k (eps 1e-6 inside the sqrt) before everything.
"""
from __future__ import annotations

import torch

from hybrid.ops.utils import acc_dtype, check_gdn_inputs, l2norm


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [B, T, H, Dk]
    k: torch.Tensor,  # [B, T, H, Dk]
    v: torch.Tensor,  # [B, T, H, Dv]
    g: torch.Tensor,  # [B, T, H] log decay (<= 0)
    beta: torch.Tensor,  # [B, T, H] write strength in (0, 1)
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # [B, H, Dk, Dv]
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,  # unused; same signature as chunk_gated_delta_rule
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step-by-step gated delta rule. Returns o [B, T, H, Dv] in v's dtype and the final state
    [B, H, Dk, Dv] (float32, float64 for float64 inputs) if output_final_state else None."""
    B, T, H, Dk, Dv = check_gdn_inputs(q, k, v, g, beta, initial_state)
    dt = acc_dtype(q, k, v, g, beta, initial_state)
    out_dtype = v.dtype
    scale = Dk ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    S = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.to(dt)  # [B, H, Dk, Dv]
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]  # [B, H, Dk, Dv]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))  # [B, H, Dv]
        S = S + k[:, t, :, :, None] * u[:, :, None, :]  # [B, H, Dk, Dv]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))  # [B, H, Dv]
    o = torch.stack(outs, dim=1) if T > 0 else v.new_zeros(B, 0, H, Dv, dtype=dt)  # [B, T, H, Dv]
    return o.to(out_dtype), (S if output_final_state else None)
