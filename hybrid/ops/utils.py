"""Shared helpers for the ops: input validation, fla's l2norm, accumulation dtype; availability checks that
``torch.compile`` reads as constants, and the CPU test switch of the CUDA path's custom ops."""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

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


# ---------------------------------------------------------------- torch.compile: constants and custom ops


def constant_under_compile(fn: Callable[[], bool]) -> Callable[[], bool]:
    """``functools.cache`` for a no-argument check (can Triton / fla / flash-attn import?), read by dynamo as a
    constant (``torch.compiler.assume_constant_result``): dynamo calls it once while tracing and puts its result in
    the graph. A ``functools.cache``'d function alone is traced through (dynamo ignores the cache wrapper, warns,
    and traces the imports, which broke the compiled decode step's graph inside Triton's ``knobs``). Eager callers
    keep the cache's semantics, ``cache_info()`` and ``cache_clear()`` included."""
    cached = functools.cache(fn)

    @torch.compiler.assume_constant_result
    @functools.wraps(fn)
    def read() -> bool:
        return cached()

    read.cache_info = cached.cache_info  # type: ignore[attr-defined]
    read.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return read


# Tests only (custom_ops_on_cpu): CPU tensors take the CUDA path's dispatch. A module global, so a compiled
# function guards on it (and recompiles when it changes).
_CPU_CUSTOM_OPS = False


@contextlib.contextmanager
def custom_ops_on_cpu() -> Iterator[None]:
    """Inside the block, CPU tensors take the dispatch that CUDA tensors take: ``"auto"`` backends resolve to the
    Triton / fla kernels (their availability assumed), and those calls go through their ``torch.library`` custom
    ops (``hybrid::decode_attention``, ``hybrid::gdn_qk_prologue``, ``hybrid::fla_recurrent_gated_delta_rule``,
    ``hybrid::gdn_decode_step``), whose CPU kernels are the PyTorch twins. For tests: the CUDA path's graph (one
    opaque op per kernel, no graph break) compiled and checked on the CPU. fla's chunk kernel (prefill past
    ``FLA_RECURRENT_MAX_T`` tokens, training) and flash-attn have no CPU kernel: keep prompts short inside."""
    global _CPU_CUSTOM_OPS
    saved = _CPU_CUSTOM_OPS
    _CPU_CUSTOM_OPS = True
    try:
        yield
    finally:
        _CPU_CUSTOM_OPS = saved


def fast_device(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the CUDA path: on CUDA, or on the CPU inside ``custom_ops_on_cpu()``."""
    return x.is_cuda or _CPU_CUSTOM_OPS


def through_custom_op(x: torch.Tensor) -> bool:
    """Whether a kernel call on ``x`` goes through its custom op: while ``torch.compile`` traces a CUDA call (one
    opaque node, no graph break), or inside ``custom_ops_on_cpu()``. Eager CUDA calls (and a CUDA graph captured
    from them) launch the kernels directly, as before the ops existed: no dispatch cost per call."""
    return _CPU_CUSTOM_OPS or (x.is_cuda and torch.compiler.is_compiling())


# Programmatic dependent launch (PDL, compute capability 9.0 and up): inside dependent_launch(), the decode
# kernels (split-KV attention and its combine, the fused GDN step) launch with Triton's ``launch_pdl``, so that a
# kernel's programs may be scheduled while the previous kernel of the stream finishes; each waits for that kernel
# (``gdc_wait``) before it reads anything. A module global read when a kernel launches (at run time, never traced).
_PDL = False


@contextlib.contextmanager
def dependent_launch(on: bool = True) -> Iterator[None]:
    """Inside the block, the decode kernels launch with programmatic dependent launch where the device has it
    (``pdl_launch``); ``hybrid.decoding.Decoder(pdl=True)`` runs its steps (and a CUDA graph's capture) inside."""
    global _PDL
    saved, _PDL = _PDL, bool(on)
    try:
        yield
    finally:
        _PDL = saved


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_supported(x: torch.Tensor) -> bool:
    """Whether ``x``'s device has programmatic dependent launch: a CUDA device of compute capability 9.0 or later
    (never the CPU, where the kernels run the interpreter or not at all)."""
    return x.is_cuda and _capability(x.device.index if x.device.index is not None else
                                     torch.cuda.current_device()) >= 9


def pdl_launch(x: torch.Tensor) -> bool:
    """Whether a decode kernel on ``x`` launches with PDL: inside ``dependent_launch()``, where it is supported."""
    return _PDL and pdl_supported(x)


def launch_options(pdl: bool, num_warps: int | None = None, num_stages: int | None = None) -> dict:
    """A decode kernel's Triton launch keywords: ``launch_pdl`` where it launches with PDL (``pdl``, from
    ``pdl_launch``), and the warps / pipeline stages a caller tuned (None: Triton's defaults)."""
    opts = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    return {**opts, "launch_pdl": True} if pdl else opts


def kernels_assumed() -> bool:
    """True inside ``custom_ops_on_cpu()``: Triton / fla count as available (their ops run the CPU twins)."""
    return _CPU_CUSTOM_OPS


def contiguous_fresh(out: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """``out`` contiguous and sharing no storage with ``inputs`` (a custom op's output may not alias its inputs)."""
    out = out.contiguous()
    for x in inputs:
        if x is not None and x.numel() and out.numel() and \
                x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            return out.clone()
    return out
