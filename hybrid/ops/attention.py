"""Softmax attention op in fla's [B, T, H, D] layout, with GQA and a decode offset.

    o = attention(q, k, v, causal=True, scale=None, backend="auto", q_offset=0)
q [B, T, H, D]; k [B, S, K, D]; v [B, S, K, Dv]; H a multiple of K (query head h reads kv head h // (H // K)).
Causal: query i sits at key position q_offset + i and sees keys j <= q_offset + i (q_offset = S - T when
decoding T new tokens against a cache of S keys; q_offset = 0 with T = S for a full sequence).
Backends: "flash" (flash_attn.flash_attn_func; fp16/bf16 CUDA; its causal mask is bottom-right aligned, so it
needs q_offset = S - T), "sdpa" (torch.nn.functional.scaled_dot_product_attention), "eager" (explicit softmax,
the naive twin), "auto" (flash where it applies, else sdpa).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.ops.utils import constant_under_compile

BACKENDS = ("auto", "sdpa", "flash", "eager")


@constant_under_compile  # cached; a constant under torch.compile (hybrid.ops.utils)
def flash_available() -> bool:
    """True if flash-attn imports."""
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def _check(q, k, v, q_offset: int, causal: bool) -> tuple[int, int, int, int, int]:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor in [B, T, H, D] layout, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k shape {tuple(k.shape)} must be [B, S, K, D] with B={B}, D={D} (q is {tuple(q.shape)})")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v shape {tuple(v.shape)} must match k {tuple(k.shape)} in [B, S, K]")
    if H % K != 0:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads K={K} (GQA)")
    if not isinstance(q_offset, int) or q_offset < 0:
        raise ValueError(f"q_offset must be a non-negative int, got {q_offset!r}")
    if causal and q_offset + T > S:
        raise ValueError(f"causal attention with q_offset={q_offset} and T={T} needs at least q_offset + T = "
                         f"{q_offset + T} keys, got S={S}; pass the cached keys together with the new ones")
    return B, T, H, S, K


def causal_mask(T: int, S: int, q_offset: int, device) -> torch.Tensor:
    """Boolean [T, S] mask, True where query i may attend key j (j <= q_offset + i)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    return j <= i + q_offset  # [T, S]


def attention_eager(q, k, v, causal: bool = True, scale: float | None = None, q_offset: int = 0) -> torch.Tensor:
    """Naive twin: explicit scores and softmax in float32 (float64 for float64 inputs). Returns [B, T, H, Dv]."""
    B, T, H, S, K = _check(q, k, v, q_offset, causal)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = H // K
    kk = k.to(dt).repeat_interleave(rep, dim=2)  # [B, S, H, D]
    vv = v.to(dt).repeat_interleave(rep, dim=2)  # [B, S, H, Dv]
    scores = torch.einsum("bthd,bshd->bhts", q.to(dt), kk) * scale  # [B, H, T, S]
    if causal:
        scores = scores.masked_fill(~causal_mask(T, S, q_offset, q.device), float("-inf"))
    p = scores.softmax(-1)  # [B, H, T, S]
    return torch.einsum("bhts,bshd->bthd", p, vv).to(q.dtype)  # [B, T, H, Dv]


def sdpa_expands_kv(is_cuda: bool, dtype: torch.dtype, has_mask: bool) -> bool:
    """Whether attention_sdpa repeats the key/value heads itself instead of passing ``enable_gqa``. On CUDA only
    the flash backend honours ``enable_gqa`` (fp16/bf16, no mask); anything else (float32, an explicit mask) would
    fall back to the math backend, which materialises [B, H, T, S] scores in float32: at 8K tokens, 2.4 GB per
    row and layer for 9 heads. Repeated heads keep the memory-efficient backend. On the CPU both give the same
    kernel (bit-identical outputs), so only a mask makes it repeat there."""
    if has_mask:
        return True
    return is_cuda and dtype not in (torch.float16, torch.bfloat16)


def attention_sdpa(q, k, v, causal: bool = True, scale: float | None = None, q_offset: int = 0) -> torch.Tensor:
    """torch SDPA. Uses is_causal only when the mask is SDPA's top-left one (q_offset = 0), else an explicit mask."""
    B, T, H, S, K = _check(q, k, v, q_offset, causal)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H|K, T|S, D]
    mask, is_causal = None, False
    if causal and q_offset == 0:
        is_causal = True
    elif causal:
        mask = causal_mask(T, S, q_offset, q.device)  # [T, S]
    if H != K and sdpa_expands_kv(q.is_cuda, q.dtype, mask is not None):
        kt, vt = kt.repeat_interleave(H // K, dim=1), vt.repeat_interleave(H // K, dim=1)  # [B, H, S, D]
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=is_causal, scale=scale,
                                       enable_gqa=kt.shape[1] != H)  # [B, H, T, Dv]
    return o.transpose(1, 2)  # [B, T, H, Dv]


@torch.compiler.disable  # a graph break under torch.compile, not a trace through fla / Triton (docs/kernels.md)
def attention_flash(q, k, v, causal: bool = True, scale: float | None = None, q_offset: int = 0) -> torch.Tensor:
    """flash_attn_func (native [B, T, H, D] layout and GQA)."""
    B, T, H, S, K = _check(q, k, v, q_offset, causal)
    if causal and q_offset != S - T:
        raise ValueError(f"backend='flash' aligns the causal mask bottom-right (q_offset = S - T = {S - T}), "
                         f"got q_offset={q_offset}; use backend='sdpa'")
    from flash_attn import flash_attn_func

    return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)  # [B, T, H, Dv]


def _flash_applies(q, k, v, causal: bool, q_offset: int) -> bool:
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] == v.shape[-1] and q.shape[-1] <= 256
            and (not causal or q_offset == k.shape[1] - q.shape[1]) and flash_available())


def attention(
    q: torch.Tensor,  # [B, T, H, D]
    k: torch.Tensor,  # [B, S, K, D]
    v: torch.Tensor,  # [B, S, K, Dv]
    causal: bool = True,
    scale: float | None = None,
    backend: str = "auto",
    q_offset: int = 0,
) -> torch.Tensor:
    """Softmax attention; returns [B, T, H, Dv] in q's dtype. Scale defaults to D ** -0.5."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "flash" if _flash_applies(q, k, v, causal, q_offset) else "sdpa"
    if backend == "flash" and not flash_available():
        raise ImportError("backend='flash' needs flash-attn: pip install flash-attn; or use backend='sdpa'")
    fn = {"sdpa": attention_sdpa, "flash": attention_flash, "eager": attention_eager}[backend]
    return fn(q, k, v, causal=causal, scale=scale, q_offset=q_offset)
