"""A decode step's projections as a bandwidth-bound GEMV: y = x @ w.T (+ b) for a few rows.

    y = decode_linear(x, weight, bias=None, backend="auto")   # x [..., K] with at most MAX_ROWS rows -> [..., N]

At decode time a projection multiplies one row per sequence (batch 1-8) by a weight that must be read whole: its
time is the weight's bytes over the memory bandwidth, if the kernel keeps enough bytes in flight. cuBLAS's kernels
for these shapes reach about two thirds of it on an H100 (docs/kernels.md, "Where the batch-1 step's time goes").
Backends:

    "torch"   the twin: ``F.linear`` (autograd works through it)
    "triton"  one kernel, grid (N / BLOCK_N,): each program streams a [BLOCK_N, K] slab of the weight once in
              [BLOCK_N, BLOCK_K] tiles and multiplies each with the rows of x (at most MAX_ROWS, padded to a
              16-row tensor-core tile: the bytes, not the products, set the time) into float32 sums; the bias is
              added and the result rounded to x's dtype once. float32 inputs multiply in full precision (not
              TF32). Forward only. Its values differ from cuBLAS's by the order of the float32 sums only
    "auto"    "triton" on CUDA when Triton imports, x has at most MAX_ROWS rows, x and the weight share a half or
              float32 dtype, K is a multiple of 8 and no gradient is needed; else "torch"

While ``torch.compile`` traces a CUDA call, "triton" runs as the custom op ``torch.ops.hybrid.decode_linear`` (one
opaque node, no graph break; its CPU kernel is the twin); eager calls launch the kernel directly. Inside
``hybrid.ops.utils.dependent_launch()`` the kernel launches with programmatic dependent launch (waits for the
kernel before it before its first load of x; the weight's first tiles do not depend on it, but are loaded after
the wait too, for simplicity).
``hybrid.layers.common.use_decode_gemv(model, True)`` routes a model's decoder-layer projections (the fused decode
input projection, o_proj, the MLP's three) and its output head through this op; rows above MAX_ROWS (prefill),
autograd and Linears with hooks keep ``F.linear`` / the Linear's own call.
BLOCK_N / BLOCK_K / warps / stages: not tuned on a GPU yet.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from hybrid.ops.prologue import triton_usable
from hybrid.ops.utils import contiguous_fresh, fast_device, launch_options, pdl_launch, through_custom_op

BACKENDS = ("auto", "torch", "triton")
MAX_ROWS = 8  # rows of x one program holds (the decode batch); more rows: the library GEMM
BLOCK_N = 16  # output columns per program: N = 2048 -> 128 programs, about one per SM of an H100
BLOCK_K = 256  # the reduction's tile: a [16, 256] bf16 tile is 8 KB
NUM_WARPS = 4
NUM_STAGES = 4  # tiles in flight per program (the bytes in flight set the bandwidth a GEMV reaches)

__all__ = ["BACKENDS", "MAX_ROWS", "decode_linear", "decode_linear_reference", "decode_linear_triton",
           "resolve_backend"]


def decode_linear_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """The twin: ``F.linear(x, weight, bias)``, x [..., K] -> [..., N]."""
    return F.linear(x, weight, bias)


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, IEEE: tl.constexpr, USE_GDC: tl.constexpr):
        if USE_GDC:  # wait for the previous kernel (x's producer) before any load
            tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        n = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN] output columns
        m = tl.arange(0, 16)  # [16] rows, M <= MAX_ROWS of them real (a tensor-core tile needs 16)
        kk = tl.arange(0, BK)  # [BK]
        nmask, mmask = n < N, m < M
        acc = tl.zeros((16, BN), dtype=tl.float32)  # [16, BN]
        for k0 in range(0, K, BK):
            k = k0 + kk  # [BK]
            kmask = k < K
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * swn + k[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0)  # [BN, BK]
            x = tl.load(x_ptr + m[:, None] * sxm + k[None, :], mask=mmask[:, None] & kmask[None, :],
                        other=0.0)  # [16, BK]
            if IEEE:  # float32 inputs: full-precision products (not TF32)
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")  # [16, BN]
            else:
                acc += tl.dot(x, tl.trans(w))  # [16, BN] half inputs, float32 sums
        if USE_GDC:  # every load done: the next kernel may be scheduled
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + m[:, None] * sym + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    return triton, gemv


def decode_linear_triton(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, block_n: int = BLOCK_N,
                         block_k: int = BLOCK_K, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES) -> Tensor:
    """The kernel (module docstring): x [..., K] with at most MAX_ROWS rows, weight [N, K] -> [..., N]. The
    keyword arguments tune it (output columns per program, the reduction's tile, Triton's warps and pipeline
    stages); the defaults are what every caller runs (research/perf/gemv_sweep.py times the others)."""
    if block_n < 16 or block_n & (block_n - 1) or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"decode_linear_triton: block_n and block_k must be powers of two >= 16 (tensor-core "
                         f"tiles), got block_n={block_n}, block_k={block_k}")
    *lead, K = x.shape
    N = weight.shape[0]
    M = math.prod(lead)
    if M > MAX_ROWS:
        raise ValueError(f"decode_linear backend='triton' takes at most {MAX_ROWS} rows, got {M}; use 'torch'")
    x2 = x.reshape(M, K)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()  # [N, K]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)  # [M, N]
    if M and N:
        _, gemv = _kernel()
        pdl = pdl_launch(x)
        gemv[(-(-N // block_n),)](x2, w, bias if bias is not None else w, y, M, N, K, x2.stride(0), w.stride(0),
                                  y.stride(0), HAS_BIAS=bias is not None, BN=block_n, BK=block_k,
                                  IEEE=x.dtype == torch.float32, USE_GDC=pdl,
                                  **launch_options(pdl, num_warps, num_stages))
    return y.view(*lead, N)  # [..., N]


# ---------------------------------------------------------------- the kernel as a custom op


@torch.library.custom_op("hybrid::decode_linear", mutates_args=(), device_types="cpu",
                         schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
def _decode_linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """CPU kernel: the twin, y [..., N] contiguous."""
    return contiguous_fresh(decode_linear_reference(x, weight, bias), x, weight, bias)


@_decode_linear_op.register_kernel("cuda")
def _decode_linear_op_cuda(x, weight, bias):
    return decode_linear_triton(x, weight, bias)


@_decode_linear_op.register_fake
def _decode_linear_op_fake(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])  # [..., N] contiguous


def resolve_backend(backend: str, x: Tensor, weight: Tensor, needs_grad: bool = False) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"decode_linear backend must be one of {BACKENDS}, got {backend!r}")
    rows = math.prod(x.shape[:-1])
    shapes_ok = (rows <= MAX_ROWS and x.dtype == weight.dtype and x.dtype != torch.float64
                 and x.shape[-1] % 8 == 0)
    if backend == "auto":
        ok = fast_device(x) and shapes_ok and not needs_grad and triton_usable()
        return "triton" if ok else "torch"
    if backend == "triton":
        if not triton_usable():
            raise ImportError("decode_linear backend='triton' needs Triton (a GPU build of torch ships it); "
                              "use 'torch'")
        if not shapes_ok:
            raise ValueError(f"decode_linear backend='triton' needs at most {MAX_ROWS} rows (got {rows}), x and the "
                             f"weight in one dtype other than float64 (got {x.dtype}, {weight.dtype}) and K a "
                             f"multiple of 8 (got {x.shape[-1]}); use 'torch'")
        if needs_grad:
            raise ValueError("decode_linear backend='triton' has no backward; call it under torch.no_grad() or use "
                             "backend='torch'")
    return backend


def decode_linear(
    x: Tensor,  # [..., K]
    weight: Tensor,  # [N, K]
    bias: Optional[Tensor] = None,  # [N]
    *,
    backend: str = "auto",
) -> Tensor:
    """``F.linear(x, weight, bias)`` by the GEMV kernel where it applies (module docstring): [..., N]."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"decode_linear: x [..., K] and weight [N, K] must share K, got x {tuple(x.shape)} and "
                         f"weight {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"decode_linear: bias must be [N] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if resolve_backend(backend, x, weight, needs_grad) != "triton":
        return decode_linear_reference(x, weight, bias)
    if not through_custom_op(x):  # eager: the kernel launched directly (or Triton's CPU interpreter)
        return decode_linear_triton(x, weight, bias)
    return _decode_linear_op(x, weight, bias)  # compiling: the custom op, one node (no graph break)
