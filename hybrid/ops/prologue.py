"""GDN branch prologue: q/k RMSNorm (Qwen3's q_norm/k_norm), RoPE, l2-norm, in one op.

    q_out, k_out = gdn_qk_prologue(q, k, q_weight, k_weight, cos, sin, eps=1e-6, norm=True, backend="auto")

q, k [B, T, H, D]; q_weight / k_weight [D] (the RMSNorm weights; ignored when norm=False); cos, sin [T, D]
(positions shared by the batch) or [B, T, D] (per-row positions, ragged decoding). Per (b, t, h) row x:

    n = x / sqrt(mean(x^2) + eps) * w            (skipped when norm=False)
    r = n * cos + rotate_half(n) * sin           (HF's rotate-half RoPE)
    y = r / sqrt(sum(r^2) + 1e-6)                (fla's in-kernel l2norm, hybrid.ops.utils.l2norm)

Returns y for q and for k, [B, T, H, D] in the input dtype, so the gated delta rule then runs with
``use_qk_l2norm_in_kernel=False``.

Backends:
    "torch"   the reference twin: today's unfused PyTorch path (qk_norm, apply_rope, l2norm), autograd
    "triton"  one Triton kernel per tensor for the forward (float32 math, one rounding) and one for the
              backward (recomputes the forward from x; dw reduced per program, then summed), through
              torch.autograd.Function
    "auto"    "triton" on CUDA when Triton imports and D / 2 is a power of two, else "torch"

While ``torch.compile`` traces a CUDA call with "triton" and no gradient needed (a compiled decode step), the
forward runs as the custom op ``torch.ops.hybrid.gdn_qk_prologue`` (``torch.library.custom_op``: one opaque node,
no graph break; its CPU kernel is the twin, its fake kernel gives the shapes); eager calls and calls with a gradient
run the compiler-disabled autograd Function (training). Triton is imported lazily (only when the "triton" backend runs).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from hybrid.ops.utils import (L2NORM_EPS, constant_under_compile, contiguous_fresh, fast_device, kernels_assumed,
                              through_custom_op)

BACKENDS = ("auto", "torch", "triton")

__all__ = ["BACKENDS", "gdn_qk_prologue", "prologue_reference", "prologue_triton", "triton_available", "triton_usable"]
# torch.ops.hybrid.gdn_qk_prologue: the Triton forward as a custom op (below), used when no gradient is needed


def _check_trig_detached(cos: torch.Tensor, sin: torch.Tensor) -> None:
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("backend='triton' has no gradient for cos/sin; pass them detached or use backend='torch'")


@constant_under_compile  # cached; a constant under torch.compile (hybrid.ops.utils)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def triton_usable() -> bool:
    """The "triton" backends may run: Triton imports, or the CPU test switch assumes it
    (``hybrid.ops.utils.custom_ops_on_cpu``, whose custom ops run the twins)."""
    return kernels_assumed() or triton_available()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D], cos/sin [T, D] or [B, T, D] -> rotated x (rotate-half convention of HF)."""
    cos, sin = (c[None, :, None, :] if c.dim() == 2 else c[:, :, None, :] for c in (cos, sin))  # [1|B, T, 1, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's q_norm/k_norm as the branch runs it (hybrid_attention.qk_norm): float32 math for half types,
    rounded once, times the weight; float64 stays float64 (via float32 as RMSNorm does)."""
    if x.dtype == torch.float64:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * w.to(x.dtype)


def _l2(x: torch.Tensor) -> torch.Tensor:
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def prologue_reference(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6, norm: bool = True):
    """The reference twin (PyTorch, autograd): RMSNorm * w, RoPE, l2-norm, each as its own op."""
    if norm:
        q, k = _rms(q, q_weight, eps), _rms(k, k_weight, eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    return _l2(q), _l2(k)  # [B, T, H, D] each


# ---------------------------------------------------------------- Triton


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def fwd(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, N, H, T, cos_sb, eps, l2eps,
            HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] rows of [N, D], N = B*T*H (int64: N*D
        # passes 2**31 at B*T*H*D, e.g. batch 8 at 128K tokens x 16 heads x 128)
        cols = tl.arange(0, HALF)  # [HALF]
        ok = rows < N
        tok = rows // H  # b*T + t
        t = tok % T
        b = tok // T
        c_off = (b * cos_sb + t * (2 * HALF))[:, None] + cols[None, :]  # [BLOCK, HALF]
        x_off = rows[:, None] * (2 * HALF) + cols[None, :]
        m = ok[:, None]
        x1 = tl.load(x_ptr + x_off, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_off + HALF, mask=m, other=0.0).to(tl.float32)
        if NORM:
            s = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps).to(tl.float32)  # [BLOCK] (eps may arrive as fp64 under torch.compile)
            w1 = tl.load(w_ptr + cols).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + cols).to(tl.float32)
            n1 = x1 * s[:, None] * w1[None, :]
            n2 = x2 * s[:, None] * w2[None, :]
        else:
            n1 = x1
            n2 = x2
        c1 = tl.load(cos_ptr + c_off, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_off + HALF, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + c_off, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + c_off + HALF, mask=m, other=0.0).to(tl.float32)
        r1 = n1 * c1 - n2 * s1
        r2 = n2 * c2 + n1 * s2
        rho = tl.rsqrt(tl.sum(r1 * r1, 1) + tl.sum(r2 * r2, 1) + l2eps).to(tl.float32)  # [BLOCK]
        tl.store(y_ptr + x_off, (r1 * rho[:, None]).to(y_ptr.dtype.element_ty), mask=m)
        tl.store(y_ptr + x_off + HALF, (r2 * rho[:, None]).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def bwd(x_ptr, w_ptr, cos_ptr, sin_ptr, dy_ptr, dx_ptr, dw_ptr, N, H, T, cos_sb, eps, l2eps, n_iter,
            HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
        pid = tl.program_id(0)
        G = tl.num_programs(0)
        cols = tl.arange(0, HALF)
        if NORM:
            w1 = tl.load(w_ptr + cols).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + cols).to(tl.float32)
        dw1 = tl.zeros([HALF], dtype=tl.float32)
        dw2 = tl.zeros([HALF], dtype=tl.float32)
        for i in range(0, n_iter):  # persistent: program pid walks blocks pid, pid + G, ... (masked past N)
            rows = (pid + i * G).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64 offsets, as in fwd
            ok = rows < N
            tok = rows // H
            t = tok % T
            b = tok // T
            c_off = (b * cos_sb + t * (2 * HALF))[:, None] + cols[None, :]
            x_off = rows[:, None] * (2 * HALF) + cols[None, :]
            m = ok[:, None]
            x1 = tl.load(x_ptr + x_off, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + x_off + HALF, mask=m, other=0.0).to(tl.float32)
            g1 = tl.load(dy_ptr + x_off, mask=m, other=0.0).to(tl.float32)
            g2 = tl.load(dy_ptr + x_off + HALF, mask=m, other=0.0).to(tl.float32)
            c1 = tl.load(cos_ptr + c_off, mask=m, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + c_off + HALF, mask=m, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + c_off, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + c_off + HALF, mask=m, other=0.0).to(tl.float32)
            if NORM:
                s = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps).to(tl.float32)  # [BLOCK] (eps may arrive as fp64 under torch.compile)
                h1 = x1 * s[:, None]  # x hat
                h2 = x2 * s[:, None]
                n1 = h1 * w1[None, :]
                n2 = h2 * w2[None, :]
            else:
                n1 = x1
                n2 = x2
            r1 = n1 * c1 - n2 * s1
            r2 = n2 * c2 + n1 * s2
            rho = tl.rsqrt(tl.sum(r1 * r1, 1) + tl.sum(r2 * r2, 1) + l2eps).to(tl.float32)  # [BLOCK]
            y1 = r1 * rho[:, None]
            y2 = r2 * rho[:, None]
            yg = tl.sum(y1 * g1, 1) + tl.sum(y2 * g2, 1)  # [BLOCK]
            dr1 = rho[:, None] * (g1 - y1 * yg[:, None])  # l2norm backward
            dr2 = rho[:, None] * (g2 - y2 * yg[:, None])
            dn1 = dr1 * c1 + dr2 * s2  # RoPE backward (the transpose of the rotation)
            dn2 = dr2 * c2 - dr1 * s1
            if NORM:
                dw1 += tl.sum(dn1 * h1, 0)
                dw2 += tl.sum(dn2 * h2, 0)
                dh1 = dn1 * w1[None, :]
                dh2 = dn2 * w2[None, :]
                hg = (tl.sum(h1 * dh1, 1) + tl.sum(h2 * dh2, 1)) / (2 * HALF)  # [BLOCK]
                dx1 = s[:, None] * (dh1 - h1 * hg[:, None])  # RMSNorm backward
                dx2 = s[:, None] * (dh2 - h2 * hg[:, None])
            else:
                dx1 = dn1
                dx2 = dn2
            tl.store(dx_ptr + x_off, dx1.to(dx_ptr.dtype.element_ty), mask=m)
            tl.store(dx_ptr + x_off + HALF, dx2.to(dx_ptr.dtype.element_ty), mask=m)
        if NORM:
            tl.store(dw_ptr + pid * (2 * HALF) + cols, dw1)
            tl.store(dw_ptr + pid * (2 * HALF) + HALF + cols, dw2)

    return triton, fwd, bwd


BLOCK_ROWS = 16  # rows (b, t, h) per program; D = 128 -> a [16, 64] tile per half
MAX_BWD_PROGRAMS = 1024  # persistent backward grid: dw partials [programs, D] float32


def _launch_shape(x: torch.Tensor, cos: torch.Tensor) -> tuple[int, int, int, int]:
    B, T, H, D = x.shape
    cos_sb = cos.stride(0) if cos.dim() == 3 else 0  # batch stride of [B, T, D] cos / sin (0: shared)
    return B * T * H, H, T, cos_sb


def _fwd_one(x, w, cos, sin, eps, norm):
    triton, fwd, _ = _kernels()
    N, H, T, cos_sb = _launch_shape(x, cos)
    y = torch.empty_like(x)
    if N:
        grid = (triton.cdiv(N, BLOCK_ROWS),)
        fwd[grid](x, w if norm else x, cos, sin, y, N, H, T, cos_sb, float(eps), float(L2NORM_EPS),
                  HALF=x.shape[-1] // 2, BLOCK=BLOCK_ROWS, NORM=norm)
    return y


def _bwd_one(x, w, cos, sin, dy, eps, norm):
    triton, _, bwd = _kernels()
    N, H, T, cos_sb = _launch_shape(x, cos)
    D = x.shape[-1]
    dx = torch.empty_like(x)
    n_blocks = triton.cdiv(N, BLOCK_ROWS)
    G = max(1, min(n_blocks, MAX_BWD_PROGRAMS))
    dw_part = torch.zeros(G, D, device=x.device, dtype=torch.float32)  # [G, D]
    if N:
        bwd[(G,)](x, w if norm else x, cos, sin, dy, dx, dw_part, N, H, T, cos_sb, float(eps), float(L2NORM_EPS),
                  triton.cdiv(n_blocks, G), HALF=D // 2, BLOCK=BLOCK_ROWS, NORM=norm)
    dw = dw_part.sum(0).to(w.dtype) if norm else None  # [D]
    return dx, dw


class _PrologueFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps, norm):
        q, k, cos, sin = (t.contiguous() for t in (q, k, cos, sin))
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps, ctx.norm = eps, norm
        return _fwd_one(q, q_weight, cos, sin, eps, norm), _fwd_one(k, k_weight, cos, sin, eps, norm)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        dq = dk = dwq = dwk = None
        if dq_out is not None and (ctx.needs_input_grad[0] or ctx.needs_input_grad[2]):
            dq, dwq = _bwd_one(q, q_weight, cos, sin, dq_out.contiguous(), ctx.eps, ctx.norm)
        if dk_out is not None and (ctx.needs_input_grad[1] or ctx.needs_input_grad[3]):
            dk, dwk = _bwd_one(k, k_weight, cos, sin, dk_out.contiguous(), ctx.eps, ctx.norm)
        return (dq if ctx.needs_input_grad[0] else None, dk if ctx.needs_input_grad[1] else None,
                dwq if ctx.needs_input_grad[2] else None, dwk if ctx.needs_input_grad[3] else None,
                None, None, None, None)


@torch.compiler.disable  # a graph break under torch.compile, not a trace through fla / Triton (docs/kernels.md)
def prologue_triton(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6, norm: bool = True):
    """The fused Triton path (forward and backward); same signature and function as ``prologue_reference``."""
    _check_trig_detached(cos, sin)
    if not norm:
        q_weight = k_weight = None
    return _PrologueFn.apply(q, k, q_weight, k_weight, cos, sin, eps, norm)


# ---------------------------------------------------------------- the forward as a custom op (decoding)


# the schema given, not inferred from this module's string annotations (``from __future__ import annotations``;
# their inference has changed between torch versions)
@torch.library.custom_op("hybrid::gdn_qk_prologue", mutates_args=(), device_types="cpu",
                         schema="(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor cos, Tensor sin, "
                                "float eps, bool norm) -> (Tensor, Tensor)")
def _prologue_op(q: Tensor, k: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor], cos: Tensor,
                 sin: Tensor, eps: float, norm: bool) -> tuple[Tensor, Tensor]:
    """CPU kernel: the twin, in q's dtype (the Triton kernel's output dtype), contiguous."""
    qo, ko = prologue_reference(q, k, q_weight, k_weight, cos, sin, eps, norm)
    return contiguous_fresh(qo.to(q.dtype), q, k), contiguous_fresh(ko.to(k.dtype), q, k)


@_prologue_op.register_kernel("cuda")
def _prologue_op_cuda(q, k, q_weight, k_weight, cos, sin, eps, norm):
    """CUDA kernel: the Triton forward (one launch per tensor)."""
    q, k, cos, sin = (t.contiguous() for t in (q, k, cos, sin))
    q_weight, k_weight = (None if w is None else w.contiguous() for w in (q_weight, k_weight))
    return _fwd_one(q, q_weight, cos, sin, eps, norm), _fwd_one(k, k_weight, cos, sin, eps, norm)


@_prologue_op.register_fake
def _prologue_op_fake(q, k, q_weight, k_weight, cos, sin, eps, norm):
    return q.new_empty(q.shape), k.new_empty(k.shape)  # [B, T, H, D] each, contiguous


def _check(q, k, q_weight, k_weight, cos, sin, norm):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, D = q.shape
    if D % 2:
        raise ValueError(f"head dim D={D} must be even (RoPE rotates halves)")
    ok_c = tuple(cos.shape) in ((T, D), (B, T, D))
    if not ok_c or cos.shape != sin.shape:
        raise ValueError(f"cos/sin must be [T, D] = [{T}, {D}] or [B, T, D] = [{B}, {T}, {D}], got "
                         f"{tuple(cos.shape)} / {tuple(sin.shape)}")
    if norm and (q_weight is None or k_weight is None or q_weight.shape != (D,) or k_weight.shape != (D,)):
        raise ValueError(f"norm=True needs q_weight and k_weight of shape [D] = [{D}], got "
                         f"{None if q_weight is None else tuple(q_weight.shape)} / "
                         f"{None if k_weight is None else tuple(k_weight.shape)}")


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"prologue backend must be one of {BACKENDS}, got {backend!r}")
    half = q.shape[-1] // 2
    pow2 = half > 0 and half & (half - 1) == 0
    triton_ok = triton_usable()
    if backend == "auto":
        return "triton" if fast_device(q) and pow2 and q.dtype != torch.float64 and triton_ok else "torch"
    if backend == "triton":
        if not triton_ok:
            raise ImportError("prologue backend='triton' needs Triton (a GPU build of torch ships it); use 'torch'")
        if not pow2:
            raise ValueError(f"prologue backend='triton' needs D / 2 a power of two, got D={q.shape[-1]}; use 'torch'")
    return backend


def gdn_qk_prologue(
    q: torch.Tensor,  # [B, T, H, D]
    k: torch.Tensor,  # [B, T, H, D]
    q_weight: torch.Tensor | None,  # [D]
    k_weight: torch.Tensor | None,  # [D]
    cos: torch.Tensor,  # [T, D] or [B, T, D]
    sin: torch.Tensor,  # [T, D] or [B, T, D]
    eps: float = 1e-6,
    norm: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (optional) + RoPE + l2-norm of q and k on the chosen backend; returns (q, k) [B, T, H, D]."""
    _check(q, k, q_weight, k_weight, cos, sin, norm)
    name = resolve_backend(backend, q)
    if name == "triton":
        _check_trig_detached(cos, sin)  # the custom op below bypasses prologue_triton's own check
        needs_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, q_weight, k_weight))
        if not needs_grad and through_custom_op(q):  # a compiled decode step: the custom op (no graph break)
            if not norm:
                q_weight = k_weight = None
            return _prologue_op(q, k, q_weight, k_weight, cos, sin, float(eps), bool(norm))
        return prologue_triton(q, k, q_weight, k_weight, cos, sin, eps, norm)  # eager, training, CPU interpreter
    return prologue_reference(q, k, q_weight, k_weight, cos, sin, eps, norm)
