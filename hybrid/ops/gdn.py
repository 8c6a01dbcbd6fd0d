"""Gated delta rule dispatch: fla's Triton kernels on CUDA when importable, else the PyTorch twins.

Backends (all compute the same function, fla's convention; see gdn_recurrent.py):
    "torch_recurrent"  plain loop over positions (reference twin; fine for decode, T = 1)
    "torch_chunk"      chunked WY form in PyTorch (autograd backward)
    "fla_chunk"        fla.ops.gated_delta_rule.chunk_gated_delta_rule (training / prefill)
    "fla_recurrent"    fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule (decode; no backward)
    "auto"             CUDA + fla: fla_recurrent when no gradient is needed and T <= FLA_RECURRENT_MAX_T,
                       else fla_chunk; otherwise torch_recurrent for T = 1 and torch_chunk beyond.

``fold_heads=True`` runs any backend on heads folded into the batch ([B, T, H, D] -> [B*H, T, 1, D]): the same
function, but fla's Triton kernels autotune per head count (their keys hold H), and a head-level hybrid has a
different GDN head count in each layer, so on a fresh GPU every distinct count paid fla's first-call autotuning
again (about 170 s per (H, D) for forward + backward on the H200). Folded, every layer shares one H = 1 tuning.

The Hopper issue (fla issue 640): fla 0.6.0 raises in backward on Hopper with 3.4.0 <= Triton < 3.7.1, because
its gated `chunk_bwd_dqkwg` kernel gave wrong results there (guard in fla/ops/common/chunk_o.py). On that
combination `fla_chunk` keeps fla's forward and, by default, computes the backward by recomputing the chunk
with `torch_chunk` (exact gradients of the same function, slower), except at head dims listed in
HOPPER_BWD_VERIFIED_DIMS. `allow_unverified_hopper_backward=True` (or env HYBRID_ALLOW_UNVERIFIED_HOPPER_BWD=1)
runs fla's own backward with the guard switched off at any head dim, for the parity test
(tests/hybrid/ops/test_gpu_kernels.py, research/fla_parity_gpu.py) that measures whether it is right.
See docs/kernels.md for the decision.

While ``torch.compile`` traces a CUDA call, "fla_recurrent" runs as the custom op
``torch.ops.hybrid.fla_recurrent_gated_delta_rule`` (``torch.library.custom_op``, forward only: one opaque node, no
graph break; its CPU kernel is the recurrent twin, its fake kernel gives the shapes); eager calls run fla's kernel
directly. "fla_chunk" (training, prefill) stays compiler-disabled: a graph break.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch
from torch import Tensor

from hybrid.ops.gdn_chunk import chunk_gated_delta_rule as torch_chunk_gated_delta_rule
from hybrid.ops.gdn_recurrent import recurrent_gated_delta_rule as torch_recurrent_gated_delta_rule
from hybrid.ops.utils import (check_gdn_inputs, constant_under_compile, contiguous_fresh, fast_device,
                              kernels_assumed, through_custom_op)

BACKENDS = ("auto", "torch_chunk", "torch_recurrent", "fla_chunk", "fla_recurrent")
FLA_RECURRENT_MAX_T = 64  # auto: decode / short no-grad calls use fla's fused recurrent kernel
HOPPER_BWD_ENV = "HYBRID_ALLOW_UNVERIFIED_HOPPER_BWD"
# (Dk, Dv) head dims at which research/fla_parity_gpu.py measured fla's guarded Hopper backward to match the
# reference (relative error <= 1e-2 for every gradient); there the guard is bypassed by default. Measured on one
# H200 (torch 2.11, Triton 3.6, fla-core 0.6.0, 2026-11-29): at T = 512 and 1024, D = 64 and 128, the bypassed
# backward's worst relative error was 5.0e-3 (docs/results/2026-11-29_gdn_kernel_parity_layer_timing/gpu_hybrid_h200.log,
# docs/results/2026-11-29_gpu_op_tests/gpu_tests_h200.log).
# D = 32 (the reference model's head dim) on 2026-12-01, T = 1024, gate normalizer 1 only: worst 4.5e-3
# (docs/results/2026-12-01_fla_parity_d32/fla_parity_d32.json).
HOPPER_BWD_VERIFIED_DIMS: frozenset[tuple[int, int]] = frozenset({(32, 32), (64, 64), (128, 128)})


@constant_under_compile  # cached; a constant under torch.compile (hybrid.ops.utils)
def fla_available() -> bool:
    """True if fla's gated delta rule kernels import (needs fla-core, Triton and a GPU build)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:
        return False
    return True


def hopper_backward_guarded() -> bool:
    """True where fla refuses the gated chunk backward (Hopper GPU with 3.4.0 <= Triton < 3.7.1), read from
    fla's own flags so the answer matches its guard exactly."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


@contextlib.contextmanager
def fla_hopper_guard_bypassed():
    """Switch off fla's Hopper/Triton backward guard (fla.ops.common.chunk_o) inside the block only."""
    import fla.ops.common.chunk_o as chunk_o

    saved = chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        yield
    finally:
        chunk_o.TRITON_ABOVE_3_7_1 = saved


def _fla_chunk_raw(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   chunk_size):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    return fla_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     chunk_size=chunk_size)


class _FlaChunkHopperBackward(torch.autograd.Function):
    """fla's chunk forward with a backward that fla's Hopper guard would refuse. bwd = "torch_chunk": recompute the
    chunk with the PyTorch twin and differentiate that (exact gradients of the same function). bwd = "fla_unguarded":
    keep fla's own graph from the forward and run its backward with the guard switched off."""

    @staticmethod
    def forward(ctx, bwd, scale, output_final_state, use_qk_l2norm_in_kernel, chunk_size,
                q, k, v, g, beta, initial_state):
        ctx.cfg = (bwd, scale, output_final_state, use_qk_l2norm_in_kernel, chunk_size)
        inputs = [None if x is None else x.detach().requires_grad_(need)
                  for x, need in zip((q, k, v, g, beta, initial_state), ctx.needs_input_grad[5:])]
        if bwd == "fla_unguarded":
            with torch.enable_grad():
                o, ht = _fla_chunk_raw(*inputs[:5], scale, inputs[5], output_final_state,
                                       use_qk_l2norm_in_kernel, chunk_size)
            ctx.inner = (inputs, o, ht)
        else:
            ctx.save_for_backward(q, k, v, g, beta, initial_state)
            o, ht = _fla_chunk_raw(q, k, v, g, beta, scale, initial_state, output_final_state,
                                   use_qk_l2norm_in_kernel, chunk_size)
        return o.detach(), (None if ht is None else ht.detach())

    @staticmethod
    def backward(ctx, do, dht):
        bwd, scale, output_final_state, use_qk_l2norm_in_kernel, chunk_size = ctx.cfg
        if bwd == "fla_unguarded":
            inputs, o, ht = ctx.inner
            del ctx.inner
            guard = fla_hopper_guard_bypassed()
        else:
            inputs = [None if x is None else x.detach().requires_grad_(need)
                      for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[5:])]
            with torch.enable_grad():
                o, ht = torch_chunk_gated_delta_rule(*inputs[:5], scale, inputs[5], output_final_state,
                                                     use_qk_l2norm_in_kernel, chunk_size)
            guard = contextlib.nullcontext()
        outs, grads_out = [o], [do]
        if ht is not None and dht is not None:
            outs.append(ht), grads_out.append(dht)
        wanted = [x for x in inputs if x is not None and x.requires_grad]
        with guard:
            grads = iter(torch.autograd.grad(outs, wanted, grads_out, allow_unused=True))
        return (None,) * 5 + tuple(next(grads) if x is not None and x.requires_grad else None for x in inputs)


def _allow_unverified(flag: bool | None) -> bool:
    if flag is not None:
        return bool(flag)
    return os.environ.get(HOPPER_BWD_ENV, "0") not in ("", "0", "false", "False")


@torch.compiler.disable  # a graph break under torch.compile, not a trace through fla / Triton (docs/kernels.md)
def fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, chunk_size=64,
                               allow_unverified_hopper_backward: bool | None = None):
    """fla's chunk kernel, with the Hopper/Triton backward handling described in the module docstring."""
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    if not needs_grad or not hopper_backward_guarded():
        return _fla_chunk_raw(q, k, v, g, beta, scale, initial_state, output_final_state,
                              use_qk_l2norm_in_kernel, chunk_size)
    verified = (q.shape[-1], v.shape[-1]) in HOPPER_BWD_VERIFIED_DIMS
    bwd = "fla_unguarded" if verified or _allow_unverified(allow_unverified_hopper_backward) else "torch_chunk"
    return _FlaChunkHopperBackward.apply(bwd, scale, output_final_state, use_qk_l2norm_in_kernel,
                                              chunk_size, q, k, v, g, beta, initial_state)


def _fla_recurrent_raw(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    """fla's fused recurrent kernel. Keyword call: fla's positional order there is (q, k, v, g, gk, gv, beta, ...)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                                            initial_state=initial_state, output_final_state=output_final_state,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


# the schema given, not inferred from this module's string annotations (``from __future__ import annotations``;
# their inference has changed between torch versions)
@torch.library.custom_op("hybrid::fla_recurrent_gated_delta_rule", mutates_args=(), device_types="cpu",
                         schema="(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale, "
                                "Tensor? initial_state, bool output_final_state, bool use_qk_l2norm_in_kernel) "
                                "-> (Tensor, Tensor)")
def _fla_recurrent_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                      initial_state: Optional[Tensor], output_final_state: bool,
                      use_qk_l2norm_in_kernel: bool) -> tuple[Tensor, Tensor]:
    """CPU kernel: the recurrent twin. Returns (o [B, T, H, Dv], final state [B, H, Dk, Dv]; an empty tensor when
    ``output_final_state`` is False: an op's outputs are tensors, ``fla_recurrent_gated_delta_rule`` makes it
    None)."""
    o, ht = torch_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel)
    ht = contiguous_fresh(ht, initial_state) if ht is not None else o.new_empty(0, dtype=torch.float32)
    return contiguous_fresh(o, v), ht


@_fla_recurrent_op.register_kernel("cuda")
def _fla_recurrent_op_cuda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    """CUDA kernel: fla's fused recurrent Triton kernel."""
    o, ht = _fla_recurrent_raw(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)
    return o, (ht if ht is not None else o.new_empty(0, dtype=torch.float32))


@_fla_recurrent_op.register_fake
def _fla_recurrent_op_fake(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    B, T, H, Dk = q.shape
    # the state: float32 from fla; the twin's accumulation dtype on the CPU (float64 for float64 inputs)
    xs = (q, k, v, g, beta, initial_state)
    st = torch.float64 if q.device.type != "cuda" and any(
        x is not None and x.dtype == torch.float64 for x in xs) else torch.float32
    ht = q.new_empty(B, H, Dk, v.shape[-1], dtype=st) if output_final_state else q.new_empty(0, dtype=torch.float32)
    return v.new_empty(v.shape), ht  # o [B, T, H, Dv] contiguous, final state [B, H, Dk, Dv]


def fla_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, chunk_size=64):
    """fla's fused recurrent kernel (forward only: fla has no backward for it); while torch.compile traces it,
    through the custom op ``torch.ops.hybrid.fla_recurrent_gated_delta_rule`` (no graph break)."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)):
        raise RuntimeError("backend='fla_recurrent' has no backward in fla; use 'fla_chunk' (or 'auto') for "
                           "training, or call under torch.no_grad() for decoding")
    if not through_custom_op(q):  # eager: fla's kernel directly
        return _fla_recurrent_raw(q, k, v, g, beta, scale, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel)
    o, ht = _fla_recurrent_op(q, k, v, g, beta, None if scale is None else float(scale), initial_state,
                              bool(output_final_state), bool(use_qk_l2norm_in_kernel))
    return o, (ht if output_final_state else None)


def resolve_backend(backend: str, q: torch.Tensor, needs_grad: bool) -> str:
    """The concrete backend that `backend` means for this input."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    T = q.shape[1]
    fla_ok = kernels_assumed() or fla_available()
    if backend == "auto":
        if fast_device(q) and fla_ok:
            return "fla_recurrent" if (not needs_grad and T <= FLA_RECURRENT_MAX_T) else "fla_chunk"
        return "torch_recurrent" if T == 1 else "torch_chunk"
    if backend.startswith("fla_"):
        if not fast_device(q):
            raise ValueError(f"backend={backend!r} needs CUDA tensors, got device {q.device}; use 'torch_chunk'")
        if not fla_ok:
            raise ImportError(f"backend={backend!r} needs fla: pip install fla-core (with Triton on a GPU machine)")
    return backend


def _fold(x: torch.Tensor | None) -> torch.Tensor | None:
    """[B, T, H, ...] -> [B*H, T, 1, ...] (heads into the batch)."""
    if x is None:
        return None
    B, T, H = x.shape[:3]
    return x.transpose(1, 2).reshape(B * H, T, 1, *x.shape[3:])


def _folded(fn, q, k, v, g, beta, scale, initial_state, output_final_state, *rest):
    """Run ``fn`` (a backend, positional order of ``gated_delta_rule``) with heads folded into the batch."""
    B, T, H = q.shape[:3]
    h0 = None if initial_state is None else initial_state.reshape(B * H, 1, *initial_state.shape[2:])
    o, ht = fn(_fold(q), _fold(k), _fold(v), _fold(g.unsqueeze(-1)).squeeze(-1),
               _fold(beta.unsqueeze(-1)).squeeze(-1), scale, h0, output_final_state, *rest)  # o [B*H, T, 1, Dv]
    o = o.reshape(B, H, T, o.shape[-1]).transpose(1, 2)  # [B, T, H, Dv]
    ht = None if ht is None else ht.reshape(B, H, *ht.shape[2:])  # [B, H, Dk, Dv]
    return o, ht


def gated_delta_rule(
    q: torch.Tensor,  # [B, T, H, Dk]
    k: torch.Tensor,  # [B, T, H, Dk]
    v: torch.Tensor,  # [B, T, H, Dv]
    g: torch.Tensor,  # [B, T, H] log decay (<= 0)
    beta: torch.Tensor,  # [B, T, H] in (0, 1)
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # [B, H, Dk, Dv]
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
    allow_unverified_hopper_backward: bool | None = None,
    fold_heads: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule on the chosen backend. Returns o [B, T, H, Dv] and final state [B, H, Dk, Dv] or None.
    ``fold_heads``: run on [B*H, T, 1, D] (one kernel tuning for every head count; see the module docstring)."""
    check_gdn_inputs(q, k, v, g, beta, initial_state)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    name = resolve_backend(backend, q, needs_grad)
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, chunk_size)
    if name == "torch_chunk":
        fn = torch_chunk_gated_delta_rule
    elif name == "torch_recurrent":
        fn = torch_recurrent_gated_delta_rule
    elif name == "fla_recurrent":
        fn = fla_recurrent_gated_delta_rule
    else:
        fn = functools.partial(fla_chunk_gated_delta_rule,
                               allow_unverified_hopper_backward=allow_unverified_hopper_backward)
    return _folded(fn, *args) if fold_heads and q.shape[2] > 1 else fn(*args)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, chunk_size=64):
    """Chunked gated delta rule: fla's chunk kernel on CUDA when fla imports, else the PyTorch chunked twin.
    Shapes as in `gated_delta_rule`."""
    check_gdn_inputs(q, k, v, g, beta, initial_state)
    backend = "fla_chunk" if (q.is_cuda and fla_available()) else "torch_chunk"
    return gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                            chunk_size, backend=backend)
