"""Decode attention: one new query per row against a preallocated KV buffer with per-row lengths (GQA).

    o = decode_attention(q, k, v, kv_len, scale=None, window=None, backend="auto")

q [B, 1, H, D]; k, v [B, S, K, D] (the whole buffer: rows past kv_len[b] are ignored); kv_len [B] long, the
number of keys row b sees (its query sits at position kv_len[b] - 1); with ``window`` only the last ``window``
of them. Query head h reads KV head h // (H / K). Returns o [B, 1, H, D] in q's dtype.

Backends:
    "torch"   the twin: SDPA with a [B, 1, rep, S] boolean mask, the query heads of one KV head as query rows
    "triton"  split-KV ("flash-decoding"): grid (B * K, splits); each program reads one stretch of its row's
              keys once for all H / K query heads of the KV head (online softmax in float32) and stops at the
              row's length; a Triton combine of the splits' (max, sum, output); both with programmatic dependent
              launch inside ``hybrid.ops.utils.dependent_launch()`` on Hopper. Needed because SDPA's kernels
              give one CTA per (row, KV head) for a single query, so one KV head at 128K keys streams 64 MB
              through one SM
    "auto"    "triton" on CUDA when Triton imports and D is a power of two, else "torch"

Under ``torch.compile`` on CUDA "triton" runs as the custom op ``torch.ops.hybrid.decode_attention``
(``torch.library.custom_op``: one opaque node, no graph break; its CPU kernel is the twin, its fake kernel gives the
shape); eager calls launch the kernels directly.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from hybrid.ops.prologue import triton_usable
from hybrid.ops.utils import contiguous_fresh, fast_device, launch_options, pdl_launch, through_custom_op

BACKENDS = ("auto", "torch", "triton")
BLOCK_N = 64  # keys per inner step
__all__ = ["decode_attention", "decode_attention_reference", "decode_attention_triton"]
# torch.ops.hybrid.decode_attention: the Triton kernels as a custom op (below)


def _check(q, k, v, kv_len):
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"q must be [B, 1, H, D] (one new token per row), got {tuple(q.shape)}")
    B, _, H, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[3] != D or v.shape != k.shape:
        raise ValueError(f"k and v must both be [B, S, K, D] = [{B}, S, K, {D}], got {tuple(k.shape)} / "
                         f"{tuple(v.shape)}")
    if H % k.shape[2]:
        raise ValueError(f"query heads H={H} must be a multiple of KV heads K={k.shape[2]}")
    if kv_len.shape != (B,):
        raise ValueError(f"kv_len must be [B] = [{B}], got {tuple(kv_len.shape)}")


def decode_attention_reference(q, k, v, kv_len, scale=None, window=None):
    """The twin: masked SDPA, KV heads not copied (query heads of a KV head as query rows)."""
    B, _, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    rep = H // K
    j = torch.arange(S, device=q.device)  # [S]
    mask = j[None, :] < kv_len[:, None]  # [B, S]
    if window is not None:
        mask = mask & (j[None, :] >= kv_len[:, None] - window)
    qg = q.reshape(B, K, rep, D)  # [B, K, rep, D]
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
                                       scale=scale)  # [B, K, rep, D]
    return o.reshape(B, 1, H, D)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kv(q_ptr, k_ptr, v_ptr, len_ptr, o_ptr, m_ptr, l_ptr, scale, window, S, chunk,
                 sqb, sqh, skb, sks, skh, NSPLIT, K: tl.constexpr, REP: tl.constexpr, RP: tl.constexpr,
                 D: tl.constexpr, BN: tl.constexpr, WINDOWED: tl.constexpr, USE_GDC: tl.constexpr):
        # USE_GDC (launched with PDL, hybrid.ops.utils.dependent_launch): PTX griddepcontrol as Triton's
        # extra.cuda.gdc_wait / gdc_launch_dependents, written out since the kernels see only `tl`
        if USE_GDC:  # wait for the previous kernel (its q, k/v writes) before any load
            tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        pid = tl.program_id(0)  # b * K + kv head
        sp = tl.program_id(1)  # split
        b = (pid // K).to(tl.int64)  # int64: b * skb passes 2**31 (e.g. 17 rows x 128K keys x 8 KV heads x 128)
        kh = pid % K
        n = tl.load(len_ptr + b)  # keys of this row
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, n)
        if WINDOWED:
            lo = tl.maximum(lo, n - window)
        r = tl.arange(0, RP)  # query rows (the REP heads of this KV head, padded)
        d = tl.arange(0, D)
        rmask = r < REP
        q = tl.load(q_ptr + b * sqb + (kh * REP + r)[:, None] * sqh + d[None, :], mask=rmask[:, None], other=0.0)
        m = tl.full([RP], float("-inf"), dtype=tl.float32)
        l = tl.zeros([RP], dtype=tl.float32)
        acc = tl.zeros([RP, D], dtype=tl.float32)
        start = (lo // BN) * BN
        for s0 in range(start, hi, BN):
            j = s0 + tl.arange(0, BN)
            jm = (j >= lo) & (j < hi)
            kt = tl.load(k_ptr + b * skb + j[None, :] * sks + kh * skh + d[:, None], mask=jm[None, :], other=0.0)
            sc = (tl.dot(q, kt) * scale).to(tl.float32)  # [RP, BN]; under torch.compile a float arg arrives as fp64
            sc = tl.where(jm[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with no visible key: no NaN
            alpha = tl.exp(m - m_safe)
            p = tl.exp(sc - m_safe[:, None])
            vv = tl.load(v_ptr + b * skb + j[:, None] * sks + kh * skh + d[None, :], mask=jm[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        if USE_GDC:  # the combine may be scheduled now; it waits for this grid's stores itself
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        heads = kh * REP + r  # [RP]
        out = (b * (K * REP) + heads) * NSPLIT + sp  # index into [B, H, NSPLIT]
        tl.store(m_ptr + out, m, mask=rmask)
        tl.store(l_ptr + out, l, mask=rmask)
        tl.store(o_ptr + out[:, None] * D + d[None, :], acc, mask=rmask[:, None])

    @triton.jit
    def combine(o_ptr, m_ptr, l_ptr, out_ptr, NSPLIT, NS: tl.constexpr, D: tl.constexpr, USE_GDC: tl.constexpr):
        if USE_GDC:
            tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        pid = tl.program_id(0)  # b * H + h
        i = tl.arange(0, NS)
        d = tl.arange(0, D)
        ok = i < NSPLIT
        m = tl.load(m_ptr + pid * NSPLIT + i, mask=ok, other=float("-inf"))
        l = tl.load(l_ptr + pid * NSPLIT + i, mask=ok, other=0.0)
        w = tl.exp(m - tl.max(m, 0))  # empty splits (m = -inf) weigh 0
        w = tl.where(ok, w, 0.0)
        o = tl.load(o_ptr + (pid * NSPLIT + i)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        if USE_GDC:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        res = tl.sum(o * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(out_ptr + pid * D + d, res.to(out_ptr.dtype.element_ty))

    return triton, split_kv, combine


def _n_splits(q: torch.Tensor, B: int, K: int, S: int, waves: int = 2, block_n: int = BLOCK_N) -> int:
    """Splits of each row's keys: about ``waves`` programs per SM over the B * K (row, KV head) pairs, at most one
    per ``block_n`` keys and 256 in all."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
    want = max(1, -(-waves * sms // (B * K)))  # about `waves` waves of programs
    return max(1, min(want, -(-S // block_n), 256))


def decode_attention_triton(q, k, v, kv_len, scale=None, window=None, *, block_n: int = BLOCK_N,
                            waves: int = 2, num_warps: int | None = None, num_stages: int | None = None):
    """Split-KV decode attention (see the module docstring); same function as the twin. The keyword arguments
    tune the split kernel (keys per inner step, programs per SM, Triton's warps and pipeline stages; None:
    Triton's defaults); the defaults are what every caller uses (research/perf/decode_attention_sweep.py times
    the others)."""
    if block_n < 16 or block_n & (block_n - 1) or waves < 1:
        raise ValueError(f"decode_attention_triton: block_n must be a power of two >= 16 and waves >= 1, "
                         f"got block_n={block_n}, waves={waves}")
    triton, split_kv, combine = _kernel()
    B, _, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    rep = H // K
    scale = D ** -0.5 if scale is None else scale
    if k.stride(3) != 1 or v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    q = q.contiguous()
    ns = _n_splits(q, B, K, S, waves, block_n)
    chunk = -(-S // ns)
    chunk = -(-chunk // block_n) * block_n
    pdl = pdl_launch(q)  # inside dependent_launch() on a Hopper-class GPU
    o_part = torch.empty(B, H, ns, D, device=q.device, dtype=torch.float32)  # [B, H, splits, D]
    m_part = torch.empty(B, H, ns, device=q.device, dtype=torch.float32)  # [B, H, splits]
    l_part = torch.empty_like(m_part)
    split_kv[(B * K, ns)](q, k, v, kv_len, o_part, m_part, l_part, float(scale), int(window or 0), S, chunk,
                          q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2), ns,
                          K=K, REP=rep, RP=max(16, triton.next_power_of_2(rep)), D=D, BN=block_n,
                          WINDOWED=window is not None, USE_GDC=pdl, **launch_options(pdl, num_warps, num_stages))
    o = torch.empty(B, 1, H, D, device=q.device, dtype=q.dtype)  # [B, 1, H, D]
    combine[(B * H,)](o_part, m_part, l_part, o, ns, NS=max(2, triton.next_power_of_2(ns)), D=D, USE_GDC=pdl,
                      **launch_options(pdl))
    return o


# the schema given, not inferred from this module's string annotations (``from __future__ import annotations``;
# their inference has changed between torch versions)
@torch.library.custom_op("hybrid::decode_attention", mutates_args=(), device_types="cpu",
                         schema="(Tensor q, Tensor k, Tensor v, Tensor kv_len, float? scale, SymInt? window) -> Tensor")
def _decode_attention_op(q: Tensor, k: Tensor, v: Tensor, kv_len: Tensor, scale: Optional[float],
                         window: Optional[int]) -> Tensor:
    """CPU kernel: the twin (masked SDPA), contiguous [B, 1, H, D]."""
    return contiguous_fresh(decode_attention_reference(q, k, v, kv_len, scale, window), q, k, v)


@_decode_attention_op.register_kernel("cuda")
def _decode_attention_op_cuda(q, k, v, kv_len, scale, window):
    """CUDA kernel: the split-KV Triton kernels (split + combine); kv_len read as a contiguous [B]."""
    return decode_attention_triton(q, k, v, kv_len.contiguous(), scale, window)


@_decode_attention_op.register_fake
def _decode_attention_op_fake(q, k, v, kv_len, scale, window):
    return q.new_empty(q.shape)  # [B, 1, H, D], contiguous


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"decode attention backend must be one of {BACKENDS}, got {backend!r}")
    D = q.shape[-1]
    pow2 = D >= 16 and D & (D - 1) == 0
    triton_ok = triton_usable()
    if backend == "auto":
        return "triton" if fast_device(q) and pow2 and q.dtype != torch.float64 and triton_ok else "torch"
    if backend == "triton" and not triton_ok:
        raise ImportError("decode attention backend='triton' needs Triton; use 'torch'")
    if backend == "triton" and not pow2:
        raise ValueError(f"decode attention backend='triton' needs D a power of two >= 16, got D={D}; use 'torch'")
    return backend


def decode_attention(
    q: torch.Tensor,  # [B, 1, H, D]
    k: torch.Tensor,  # [B, S, K, D]
    v: torch.Tensor,  # [B, S, K, D]
    kv_len: torch.Tensor,  # [B] long
    scale: float | None = None,
    window: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of one new query per row over the first kv_len[b] keys (the last ``window`` of them)."""
    _check(q, k, v, kv_len)
    if resolve_backend(backend, q) != "triton":
        return decode_attention_reference(q, k, v, kv_len, scale, window)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if through_custom_op(q) and not needs_grad:  # compiling: the custom op, one node, no graph break
        return _decode_attention_op(q, k, v, kv_len, None if scale is None else float(scale),
                                    None if window is None else int(window))
    return decode_attention_triton(q, k, v, kv_len, scale, window)  # eager (or Triton's CPU interpreter)
