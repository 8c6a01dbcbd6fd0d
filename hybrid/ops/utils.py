"""Shared helpers for the GDN ops: input validation, fla's l2norm, accumulation dtype."""
from __future__ import annotations

import torch

L2NORM_EPS = 1e-6  # fla's l2norm: x / sqrt(sum(x^2) + 1e-6), fla/modules/norm/l2norm.py


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """fla's in-kernel l2norm over the last dim (eps inside the square root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def acc(x: torch.Tensor) -> torch.Tensor:
    """x in float32 when it is a half type (bf16/fp16), else unchanged (float64 stays float64)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def acc_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    """Internal accumulation dtype: float64 if any input is float64, else float32."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def check_gdn_inputs(q, k, v, g, beta, initial_state=None) -> tuple[int, int, int, int, int]:
    """Validate gated-delta-rule inputs (fla layout); return (B, T, H, Dk, Dv)."""
    for name, x, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != nd:
            raise ValueError(f"{name} must have {nd} dims in fla's [B, T, H, ...] layout, got shape {tuple(x.shape)}")
    B, T, H, Dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)} ([B, T, H, Dk])")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v shape {tuple(v.shape)} must be [B, T, H, Dv] = [{B}, {T}, {H}, Dv]; "
                         "expand GQA key/value heads to one per query head first")
    Dv = v.shape[3]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, H):
            raise ValueError(f"{name} shape {tuple(x.shape)} must be [B, T, H] = [{B}, {T}, {H}]")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, Dk, Dv):
        raise ValueError(f"initial_state shape {tuple(initial_state.shape)} must be [B, H, Dk, Dv] = "
                         f"[{B}, {H}, {Dk}, {Dv}]")
    return B, T, H, Dk, Dv
