"""The GDN branch's decode step (one token per row) after its projections, as one op (one Triton kernel on CUDA).

    o = gdn_decode_step(q, k, v, b, a, state, q_weight, k_weight, cos, sin, eps=1e-6, norm=True, decay="gdn",
                        A_log=A_log, dt_bias=dt_bias, scale=D ** -0.5)          # state updated in place

q, k, v [B, 1, H, D] (the projections, after the short conv when it is on); b, a [B, 1, H] (b_proj(x) and
a_proj(x)); state [B, H, D, D] (the static cache's GDN state, [B, H, Dk, Dv], float32; float64 for a float64
model), written IN PLACE so its address never changes (a CUDA graph replays the same pointers); cos, sin [1, D]
(positions shared by the batch) or [B, 1, D] (per-row positions). Returns o [B, 1, H, D] in v's dtype.

Per (row b, head h), what ``GatedDeltaNetBranch.forward`` computes for T = 1 (the "split" path):

    q, k  <- RMSNorm(x) * w (norm=True), RoPE (rotate-half), l2-norm       hybrid.ops.prologue
    beta   = sigmoid(b)
    g      = -exp(A_log) * softplus(a + dt_bias)     (decay="gdn")
           = logsigmoid(a + a_bias)                  (decay="simple")
    S     <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T (scale q)   hybrid.ops.gdn_recurrent

Backends:
    "torch"   the twin: the branch's own ops for T = 1 (``prologue_reference``, the dtype casts, sigmoid, the log
              decay, ``recurrent_gated_delta_rule``), then ``state.copy_``; autograd works through it
    "triton"  one kernel, grid (B * H, D / BLOCK_V): each program recomputes its head's q/k prologue and gates in
              float32 registers and steps one [D, BLOCK_V] tile of the state (loaded, updated, stored in place).
              It replaces, per GDN branch and step, the two prologue kernels, the casts, the sigmoid, the log
              decay's kernels, fla's recurrent kernel and the state copy. Forward only (no backward). Its values
              differ from the twin's in half types by rounding only: the twin rounds q, k and beta to v's dtype
              before the recurrence (as the branch does), the kernel keeps them in float32
    "auto"    "triton" on CUDA when Triton imports, D is a power of two >= 16, the inputs are not float64 and no
              gradient is needed; else "torch"

While ``torch.compile`` traces a CUDA call, "triton" runs as the custom op ``torch.ops.hybrid.gdn_decode_step``
(``torch.library.custom_op`` with ``mutates_args=("state",)``: one opaque node, no graph break; its CPU kernel is
the twin, its fake kernel gives the shape); eager calls launch the kernel directly. Triton is imported lazily
(only when the "triton" backend runs).
``hybrid.layers.hybrid_attention.use_fused_decode(model, True)`` switches every GDN branch of a model to this op
for its per-row static-cache steps of one token (``GatedDeltaNetBranch.decode_backend``: "split", today's path
and the default, or "fused"); docs/kernels.md.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from hybrid.ops.gdn_recurrent import recurrent_gated_delta_rule
from hybrid.ops.prologue import prologue_reference, triton_usable
from hybrid.ops.utils import (L2NORM_EPS, acc, contiguous_fresh, fast_device, launch_options, pdl_launch,
                              through_custom_op)

BACKENDS = ("auto", "torch", "triton")
DECAYS = ("gdn", "simple")
DECODE_BACKENDS = ("split", "fused")  # GatedDeltaNetBranch.decode_backend
BLOCK_V = 32  # value columns of the state per program (D = 128: a [128, 32] float32 tile, 4 programs per head);
# not tuned on a GPU yet

__all__ = ["BACKENDS", "DECODE_BACKENDS", "gdn_decode_step", "gdn_decode_step_reference", "gdn_decode_step_triton",
           "resolve_backend"]


def log_decay(a: torch.Tensor, decay: str, A_log=None, dt_bias=None, a_bias=None) -> torch.Tensor:
    """a [B, T, H] -> g [B, T, H] (float32 for half types): GatedDeltaNetBranch.log_decay's values."""
    a = acc(a)  # [B, T, H]
    if decay == "gdn":
        return -acc(A_log).exp() * F.softplus(a + acc(dt_bias))
    return F.logsigmoid(a + acc(a_bias))


def gdn_decode_step_reference(q, k, v, b, a, state, q_weight, k_weight, cos, sin, *, eps: float = 1e-6,
                              norm: bool = True, decay: str = "gdn", A_log=None, dt_bias=None, a_bias=None,
                              scale: float | None = None) -> torch.Tensor:
    """The twin: the split path's ops for T = 1, the state copied back in place. Returns o [B, 1, H, D]."""
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    qn, kn = prologue_reference(q, k, q_weight, k_weight, cos, sin, eps, norm)  # [B, 1, H, D] each, unit norm
    qn, kn = qn.to(v.dtype), kn.to(v.dtype)  # [B, 1, H, D]
    beta = torch.sigmoid(acc(b)).to(v.dtype)  # [B, 1, H]
    g = log_decay(a, decay, A_log, dt_bias, a_bias)  # [B, 1, H]
    o, new = recurrent_gated_delta_rule(qn, kn, v, g, beta, scale=scale, initial_state=state,
                                        output_final_state=True)  # [B, 1, H, D], [B, H, D, D]
    state.copy_(new)
    return o


# ---------------------------------------------------------------- Triton


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def step(q_ptr, k_ptr, v_ptr, b_ptr, a_ptr, s_ptr, o_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, p1_ptr, p2_ptr,
             H, sqb, sqh, skb, skh, svb, svh, sbb, sbh, sab, sah, cos_sb, eps, l2eps, scale,
             D: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr, GDN: tl.constexpr, USE_GDC: tl.constexpr):
        # USE_GDC (launched with PDL, hybrid.ops.utils.dependent_launch): PTX griddepcontrol as Triton's
        # extra.cuda.gdc_wait / gdc_launch_dependents, written out since the kernel sees only `tl`
        if USE_GDC:  # wait for the previous kernel (the projections) before any load
            tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        pid = tl.program_id(0)  # b * H + h
        vb = tl.program_id(1)  # value block
        row = (pid // H).to(tl.int64)  # int64: row * H * D * D offsets
        h = pid % H
        d = tl.arange(0, D)  # [D] key dim
        rot = (d + D // 2) % D  # [D]
        sign = tl.where(d < D // 2, -1.0, 1.0)  # [D] rotate_half(x) = cat(-x2, x1)
        c = tl.load(cos_ptr + row * cos_sb + d).to(tl.float32)  # [D]
        s = tl.load(sin_ptr + row * cos_sb + d).to(tl.float32)  # [D]
        # q and k: RMSNorm * w (NORM), RoPE, l2-norm, in float32 (written out twice: a @triton.jit helper made
        # inside _kernel() is not visible to the kernel's compiler, which reads module globals)
        x = tl.load(q_ptr + row * sqb + h * sqh + d).to(tl.float32)  # [D]
        xr = tl.load(q_ptr + row * sqb + h * sqh + rot).to(tl.float32)  # [D] x at the rotate-half partner index
        if NORM:
            r = tl.rsqrt((tl.sum(x * x, 0) / D + eps).to(tl.float32))  # scalar (eps may arrive as fp64)
            x = x * r * tl.load(qw_ptr + d).to(tl.float32)
            xr = xr * r * tl.load(qw_ptr + rot).to(tl.float32)
        y = x * c + sign * xr * s  # [D] RoPE: x * cos + rotate_half(x) * sin
        qn = y * tl.rsqrt((tl.sum(y * y, 0) + l2eps).to(tl.float32))  # [D] unit norm
        x = tl.load(k_ptr + row * skb + h * skh + d).to(tl.float32)  # [D]
        xr = tl.load(k_ptr + row * skb + h * skh + rot).to(tl.float32)  # [D]
        if NORM:
            r = tl.rsqrt((tl.sum(x * x, 0) / D + eps).to(tl.float32))
            x = x * r * tl.load(kw_ptr + d).to(tl.float32)
            xr = xr * r * tl.load(kw_ptr + rot).to(tl.float32)
        y = x * c + sign * xr * s  # [D]
        kn = y * tl.rsqrt((tl.sum(y * y, 0) + l2eps).to(tl.float32))  # [D] unit norm
        beta = tl.sigmoid(tl.load(b_ptr + row * sbb + h * sbh).to(tl.float32))  # scalar
        z = tl.load(a_ptr + row * sab + h * sah).to(tl.float32)  # scalar a
        if GDN:  # g = -exp(A_log) * softplus(a + dt_bias), softplus as torch's (threshold 20), accurate log1p
            z = z + tl.load(p2_ptr + h).to(tl.float32)
            e = tl.exp(tl.minimum(z, 20.0))
            w = 1.0 + e
            sp = tl.where(z > 20.0, z, tl.where(w == 1.0, e, tl.log(w) * e / (w - 1.0)))
            g = -tl.exp(tl.load(p1_ptr + h).to(tl.float32)) * sp
        else:  # g = logsigmoid(a + a_bias) = min(z, 0) - log1p(exp(-|z|))
            z = z + tl.load(p1_ptr + h).to(tl.float32)
            e = tl.exp(-tl.abs(z))
            w = 1.0 + e
            g = tl.minimum(z, 0.0) - tl.where(w == 1.0, e, tl.log(w) * e / (w - 1.0))
        j = vb * BV + tl.arange(0, BV)  # [BV] value columns of this program
        st = s_ptr + (row * H + h) * (D * D) + d[:, None] * D + j[None, :]  # [D, BV] state tile pointers
        S = tl.load(st).to(tl.float32) * tl.exp(g)  # [D, BV] decayed state
        v = tl.load(v_ptr + row * svb + h * svh + j).to(tl.float32)  # [BV]
        u = beta * (v - tl.sum(kn[:, None] * S, 0))  # [BV] delta-rule correction
        S = S + kn[:, None] * u[None, :]  # [D, BV]
        if USE_GDC:  # the next kernel may be scheduled now; it waits for this grid's stores itself
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.store(st, S)
        qs = (qn * scale).to(tl.float32)  # [D] (under torch.compile a float arg arrives as fp64)
        o = tl.sum(qs[:, None] * S, 0)  # [BV] read after the write
        tl.store(o_ptr + (row * H + h) * D + j, o.to(o_ptr.dtype.element_ty))

    return triton, step


def gdn_decode_step_triton(q, k, v, b, a, state, q_weight, k_weight, cos, sin, *, eps: float = 1e-6,
                           norm: bool = True, decay: str = "gdn", A_log=None, dt_bias=None, a_bias=None,
                           scale: float | None = None, block_v: int = BLOCK_V, num_warps: int | None = None,
                           num_stages: int | None = None) -> torch.Tensor:
    """The fused kernel (see the module docstring); same function as the twin, forward only. ``block_v`` (value
    columns per program), ``num_warps`` / ``num_stages`` (Triton's; None: its defaults) tune it; the defaults are
    what every caller runs (research/perf/gdn_step_sweep.py times the others)."""
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"gdn_decode_step_triton: block_v must be a power of two >= 16, got {block_v}")
    _check_triton(q, k, v, state, cos, sin)
    triton, step = _kernel()
    B, _, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    cos_sb = cos.stride(0) if cos.dim() == 3 else 0  # [B, 1, D] per-row positions, or [1, D] shared
    p1, p2 = (A_log, dt_bias) if decay == "gdn" else (a_bias, a_bias)  # [H] each
    o = torch.empty(B, 1, H, D, device=v.device, dtype=v.dtype)  # [B, 1, H, D]
    bv = min(D, block_v)
    pdl = pdl_launch(v)  # inside dependent_launch() on a Hopper-class GPU
    if B * H:
        step[(B * H, D // bv)](q, k, v, b, a, state, o, q_weight if norm else q, k_weight if norm else k, cos, sin,
                               p1, p2, H, q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0),
                               v.stride(2), b.stride(0), b.stride(2), a.stride(0), a.stride(2), cos_sb, float(eps),
                               float(L2NORM_EPS), float(scale), D=D, BV=bv, NORM=norm, GDN=decay == "gdn",
                               USE_GDC=pdl, **launch_options(pdl, num_warps, num_stages))
    return o


def _check_triton(q, k, v, state, cos, sin):
    """What the kernel needs beyond ``_check``: unit last strides and a contiguous float32 state."""
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin)) or not state.is_contiguous():
        raise ValueError("gdn_decode_step backend='triton' needs q/k/v/cos/sin with unit stride in the last dim and "
                         "a contiguous state (the static cache's buffer is); use backend='torch'")
    if state.dtype != torch.float32:
        raise ValueError(f"gdn_decode_step backend='triton' needs a float32 state, got {state.dtype}; use "
                         "backend='torch' (a float64 model)")


# ---------------------------------------------------------------- the kernel as a custom op


# the schema given, not inferred from this module's string annotations (``from __future__ import annotations``;
# their inference has changed between torch versions)
@torch.library.custom_op("hybrid::gdn_decode_step", mutates_args=("state",), device_types="cpu",
                         schema="(Tensor q, Tensor k, Tensor v, Tensor b, Tensor a, Tensor(a!) state, "
                                "Tensor? q_weight, Tensor? k_weight, Tensor cos, Tensor sin, float eps, bool norm, "
                                "str decay, Tensor? A_log, Tensor? dt_bias, Tensor? a_bias, float scale) -> Tensor")
def _gdn_decode_op(q: Tensor, k: Tensor, v: Tensor, b: Tensor, a: Tensor, state: Tensor, q_weight: Optional[Tensor],
                   k_weight: Optional[Tensor], cos: Tensor, sin: Tensor, eps: float, norm: bool, decay: str,
                   A_log: Optional[Tensor], dt_bias: Optional[Tensor], a_bias: Optional[Tensor],
                   scale: float) -> Tensor:
    """CPU kernel: the twin (``state`` stepped in place), o [B, 1, H, D] contiguous."""
    o = gdn_decode_step_reference(q, k, v, b, a, state, q_weight, k_weight, cos, sin, eps=eps, norm=norm,
                                  decay=decay, A_log=A_log, dt_bias=dt_bias, a_bias=a_bias, scale=scale)
    return contiguous_fresh(o, q, k, v, state)


@_gdn_decode_op.register_kernel("cuda")
def _gdn_decode_op_cuda(q, k, v, b, a, state, q_weight, k_weight, cos, sin, eps, norm, decay, A_log, dt_bias, a_bias,
                        scale):
    """CUDA kernel: the fused Triton kernel (``state`` stepped in place). The public function checked the strides
    eagerly; under torch.compile a layout that inductor chose is made unit-stride here rather than refused."""
    q, k, v, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, cos, sin))
    return gdn_decode_step_triton(q, k, v, b, a, state, q_weight, k_weight, cos, sin, eps=eps, norm=norm,
                                  decay=decay, A_log=A_log, dt_bias=dt_bias, a_bias=a_bias, scale=scale)


@_gdn_decode_op.register_fake
def _gdn_decode_op_fake(q, k, v, b, a, state, q_weight, k_weight, cos, sin, eps, norm, decay, A_log, dt_bias, a_bias,
                        scale):
    return v.new_empty(v.shape)  # o [B, 1, H, D] in v's dtype, contiguous


def _check(q, k, v, b, a, state, q_weight, k_weight, cos, sin, norm, decay, A_log, dt_bias, a_bias):
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"gdn_decode_step: q must be [B, 1, H, D] (one token per row, T == 1), got "
                         f"{tuple(q.shape)}; for T > 1 use the split path (gdn_qk_prologue + gated_delta_rule)")
    B, _, H, D = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"gdn_decode_step: k and v must be [B, 1, H, D] = {tuple(q.shape)} like q, got "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")
    if D % 2:
        raise ValueError(f"gdn_decode_step: head dim D={D} must be even (RoPE rotates halves)")
    for name, x in (("b", b), ("a", a)):
        if tuple(x.shape) != (B, 1, H):
            raise ValueError(f"gdn_decode_step: {name} must be [B, 1, H] = [{B}, 1, {H}], got {tuple(x.shape)}")
    if tuple(state.shape) != (B, H, D, D):
        raise ValueError(f"gdn_decode_step: state must be [B, H, D, D] = [{B}, {H}, {D}, {D}] (the static cache's "
                         f"GDN state, StaticHybridCache.allocate), got {tuple(state.shape)}")
    if state.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"gdn_decode_step: state must be float32 (float64 for a float64 model), got {state.dtype}")
    if tuple(cos.shape) not in ((1, D), (B, 1, D)) or cos.shape != sin.shape:
        raise ValueError(f"gdn_decode_step: cos/sin must be [1, D] = [1, {D}] or [B, 1, D] = [{B}, 1, {D}], got "
                         f"{tuple(cos.shape)} / {tuple(sin.shape)}")
    if norm and (q_weight is None or k_weight is None or q_weight.shape != (D,) or k_weight.shape != (D,)):
        raise ValueError(f"gdn_decode_step: norm=True needs q_weight and k_weight of shape [D] = [{D}]; pass "
                         "norm=False for a model without q/k norm")
    if decay not in DECAYS:
        raise ValueError(f"gdn_decode_step: decay must be one of {DECAYS}, got {decay!r}")
    params = (("A_log", A_log), ("dt_bias", dt_bias)) if decay == "gdn" else (("a_bias", a_bias),)
    for name, p in params:
        if p is None or tuple(p.shape) != (H,):
            raise ValueError(f"gdn_decode_step: decay={decay!r} needs {name} of shape [H] = [{H}], got "
                             f"{None if p is None else tuple(p.shape)}")


def resolve_backend(backend: str, q: torch.Tensor, needs_grad: bool = False) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"gdn_decode_step backend must be one of {BACKENDS}, got {backend!r}")
    D = q.shape[-1]
    pow2 = D >= 16 and D & (D - 1) == 0
    triton_ok = triton_usable()
    if backend == "auto":
        ok = fast_device(q) and pow2 and q.dtype != torch.float64 and not needs_grad and triton_ok
        return "triton" if ok else "torch"
    if backend == "triton":
        if not triton_ok:
            raise ImportError("gdn_decode_step backend='triton' needs Triton (a GPU build of torch ships it); "
                              "use 'torch'")
        if not pow2:
            raise ValueError(f"gdn_decode_step backend='triton' needs D a power of two >= 16, got D={D}; use 'torch'")
        if needs_grad:
            raise ValueError("gdn_decode_step backend='triton' has no backward; call it under torch.no_grad() "
                             "or use backend='torch'")
    return backend


def gdn_decode_step(
    q: torch.Tensor,  # [B, 1, H, D]
    k: torch.Tensor,  # [B, 1, H, D]
    v: torch.Tensor,  # [B, 1, H, D]
    b: torch.Tensor,  # [B, 1, H] b_proj(x): beta = sigmoid(b)
    a: torch.Tensor,  # [B, 1, H] a_proj(x): the decay's input
    state: torch.Tensor,  # [B, H, D, D] float32, updated in place
    q_weight: torch.Tensor | None,  # [D] q RMSNorm weight (norm=True)
    k_weight: torch.Tensor | None,  # [D] k RMSNorm weight (norm=True)
    cos: torch.Tensor,  # [1, D] or [B, 1, D]
    sin: torch.Tensor,  # [1, D] or [B, 1, D]
    *,
    eps: float = 1e-6,
    norm: bool = True,
    decay: str = "gdn",
    A_log: torch.Tensor | None = None,  # [H] (decay="gdn")
    dt_bias: torch.Tensor | None = None,  # [H] (decay="gdn")
    a_bias: torch.Tensor | None = None,  # [H] (decay="simple")
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One GDN decode step after the projections (module docstring): returns o [B, 1, H, D], steps ``state``."""
    _check(q, k, v, b, a, state, q_weight, k_weight, cos, sin, norm, decay, A_log, dt_bias, a_bias)
    params = (q, k, v, b, a, q_weight, k_weight, A_log, dt_bias, a_bias)
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in params)
    kw = dict(eps=eps, norm=norm, decay=decay, A_log=A_log, dt_bias=dt_bias, a_bias=a_bias, scale=scale)
    if resolve_backend(backend, q, needs_grad) != "triton":
        return gdn_decode_step_reference(q, k, v, b, a, state, q_weight, k_weight, cos, sin, **kw)
    if not through_custom_op(q):  # eager: the kernel launched directly (or Triton's CPU interpreter)
        return gdn_decode_step_triton(q, k, v, b, a, state, q_weight, k_weight, cos, sin, **kw)
    _check_triton(q, k, v, state, cos, sin)  # the kernel's errors, raised here (while tracing)
    if not norm:
        q_weight = k_weight = None
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # compiling: the custom op, one node (no graph break); it declares the in-place write of state
    return _gdn_decode_op(q, k, v, b, a, state, q_weight, k_weight, cos, sin, float(eps), bool(norm), decay, A_log,
                          dt_bias, a_bias, scale)
