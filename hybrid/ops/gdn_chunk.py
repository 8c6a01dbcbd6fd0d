"""Chunked gated delta rule in pure PyTorch (WY representation), differentiable by autograd.

Same function as `recurrent_gated_delta_rule` (fla's convention), computed chunk by chunk. Inside a chunk of
C positions with cumulative log decay G_i = g_1 + ... + g_i and incoming state S0 [Dk, Dv]:
    S_i = exp(G_i) S0 + sum_{j<=i} exp(G_i - G_j) k_j u_j^T
    u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j)
so (I + A) U = beta * V - (beta * exp(G) * K) S0 with A_ij = beta_i exp(G_i - G_j) k_i . k_j (j < i), i.e.
    U = Ut - W S0,   Ut = (I + A)^-1 (beta * V),   W = (I + A)^-1 (beta * exp(G) * K)     (the WY form)
    O = (exp(G) * Q) S0 + ((Q K^T) * exp(G_i - G_j) [j <= i]) U                           (Q pre-scaled)
    S_C = exp(G_C) S0 + (exp(G_C - G) * K)^T U
All intra-chunk terms are computed for every chunk at once; only the state hand-off loops over chunks.
T is zero-padded to a multiple of C (k = v = q = beta = g = 0 leaves the state unchanged).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.ops.utils import acc_dtype, check_gdn_inputs, l2norm


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [B, T, H, Dk]
    k: torch.Tensor,  # [B, T, H, Dk]
    v: torch.Tensor,  # [B, T, H, Dv]
    g: torch.Tensor,  # [B, T, H] log decay (<= 0)
    beta: torch.Tensor,  # [B, T, H] write strength in (0, 1)
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # [B, H, Dk, Dv]
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule. Returns o [B, T, H, Dv] in v's dtype and the final state [B, H, Dk, Dv]
    (float32, float64 for float64 inputs) if output_final_state else None."""
    B, T, H, Dk, Dv = check_gdn_inputs(q, k, v, g, beta, initial_state)
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    dt = acc_dtype(q, k, v, g, beta, initial_state)
    out_dtype = v.dtype
    scale = Dk ** -0.5 if scale is None else scale
    C = chunk_size
    N = (T + C - 1) // C  # number of chunks
    pad = N * C - T

    # to [B, H, T, D] in the accumulation dtype, l2norm, scale, pad
    q, k, v = (x.transpose(1, 2).to(dt) for x in (q, k, v))  # [B, H, T, D]
    g, beta = (x.transpose(1, 2).to(dt) for x in (g, beta))  # [B, H, T]
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v))  # [B, H, N, C, D]
    g, beta = (x.reshape(B, H, N, C) for x in (g, beta))  # [B, H, N, C]

    # intra-chunk quantities, all chunks at once
    G = g.cumsum(-1)  # [B, H, N, C] cumulative log decay inside each chunk
    diff = G[..., :, None] - G[..., None, :]  # [B, H, N, C, C] G_i - G_j
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    decay = diff.masked_fill(~incl, float("-inf")).exp()  # [B, H, N, C, C]; mask before exp (no overflow)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)  # j < i
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)  # [B, H, N, C, C]
    IA = A + torch.eye(C, dtype=dt, device=q.device)  # [B, H, N, C, C] unit lower triangular
    rhs = torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], dim=-1)  # [B, H, N, C, Dv+Dk]
    sol = torch.linalg.solve_triangular(IA, rhs, upper=False, unitriangular=True)  # [B, H, N, C, Dv+Dk]
    Ut, W = sol[..., :Dv], sol[..., Dv:]  # [B, H, N, C, Dv], [B, H, N, C, Dk]
    P = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C] decayed causal scores (incl. diagonal)
    q_dec = q * G.exp()[..., None]  # [B, H, N, C, Dk] queries reading the incoming state
    G_last = G[..., -1]  # [B, H, N]
    k_dec = k * (G_last[..., None] - G).exp()[..., None]  # [B, H, N, C, Dk] keys decayed to chunk end

    # inter-chunk: hand the state from chunk to chunk
    S = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.to(dt)  # [B, H, Dk, Dv]
    outs = []
    for n in range(N):
        U = Ut[:, :, n] - W[:, :, n] @ S  # [B, H, C, Dv]
        outs.append(q_dec[:, :, n] @ S + P[:, :, n] @ U)  # [B, H, C, Dv]
        S = G_last[:, :, n, None, None].exp() * S + k_dec[:, :, n].transpose(-1, -2) @ U  # [B, H, Dk, Dv]
    if N:
        o = torch.stack(outs, dim=2).reshape(B, H, N * C, Dv)[:, :, :T]  # [B, H, T, Dv]
    else:
        o = q.new_zeros(B, H, 0, Dv)
    o = o.transpose(1, 2).to(out_dtype)  # [B, T, H, Dv]
    return o, (S if output_final_state else None)
