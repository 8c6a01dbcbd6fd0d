"""Counting the aten ops (~ GPU kernels) of one decode step, per layer (CPU), to keep the decode step lean.

A decode step (one token per row) of a small model on the GPU is bound by how many kernels it launches (each
~2-4 us even replayed from a CUDA graph), so ``count_step`` counts them on the CPU: ops are recorded with a
TorchDispatchMode during one ``hybrid.decoding.Decoder`` step, by scope (``"layer l"`` inside decoder layer l,
``"outside"`` for embedding, begin_step, final norm, lm_head) and op name. Calls that are fused kernels on CUDA
but composites on the CPU count as their CUDA kernels (``FUSED_ON_CUDA``), views and allocations not at all
(``VIEW_OPS``), so ``layer_ops(model)`` approximates the kernels per layer of a CUDA step.
research/count_decode_ops.py prints them for the teacher and the 7:1 hybrid; tests pin an upper bound.
"""
from __future__ import annotations

import importlib
from collections import Counter
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "counting", "count_step", "summarize", "layer_ops", "VIEW_OPS", "FUSED_ON_CUDA"]

# ops that only make views / read metadata (no kernel)
VIEW_OPS = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "permute",
            "transpose", "t", "as_strided", "alias", "detach", "split", "chunk", "unbind", "lift_fresh",
            "_reshape_alias", "split_with_sizes", "diagonal", "view_as_real", "view_as_complex", "unfold",
            "_to_copy_noop", "numpy_T", "expand_as", "view_as", "narrow",
            "empty", "new_empty", "empty_like", "empty_strided"}  # allocations: no kernel either


# calls that are one fused kernel on CUDA but many aten ops on the CPU: counted as one op named after them
# (decode attention is 2 Triton kernels on CUDA, split + combine; the GDN step one fla kernel; the prologue one)
FUSED_ON_CUDA = {"rms_norm": 1, "decode_attention": 2, "gated_delta_rule": 1, "gdn_qk_prologue": 1}


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name into ``self.counts[scope]`` (scope set by the caller); inside a call of
    FUSED_ON_CUDA only that call is counted (``inside``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scope = "outside"
        self.inside = 0
        self.counts: dict[str, Counter] = {}

    def add(self, name: str, n: int = 1) -> None:
        self.counts.setdefault(self.scope, Counter())[name] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _FusedCalls(TorchFunctionMode):
    """F.rms_norm counted as one op (a fused kernel on CUDA; a composite of five on the CPU)."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (F.rms_norm, torch.rms_norm) and not self.counter.inside:
            self.counter.add("rms_norm")
            self.counter.inside += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.counter.inside -= 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(counter: OpCounter):
    """Count with ``counter``; the hybrid's attention / GDN / prologue calls count as their CUDA kernels."""
    ops, da, pro = (importlib.import_module(f"hybrid.ops{m}") for m in ("", ".decode_attention", ".prologue"))

    def wrap(fn, name):
        def run(*a, **k):
            if counter.inside:
                return fn(*a, **k)
            counter.add(name, FUSED_ON_CUDA[name])
            counter.inside += 1
            try:
                return fn(*a, **k)
            finally:
                counter.inside -= 1
        return run

    saved = [(da, "decode_attention"), (ops, "gated_delta_rule"), (pro, "gdn_qk_prologue")]
    originals = [getattr(m, n) for m, n in saved]
    for m, n in saved:
        setattr(m, n, wrap(getattr(m, n), n))
    try:
        with counter, _FusedCalls(counter):
            yield counter
    finally:
        for (m, n), fn in zip(saved, originals):
            setattr(m, n, fn)


@torch.no_grad()
def count_step(model, batch: int = 1, context: int = 16) -> dict[str, Counter]:
    """Aten ops of one Decoder step (after one warm step), by scope ("layer l" / "outside") and op name."""
    from hybrid.decoding import Decoder, prefill

    torch.manual_seed(1)
    prompts = [torch.randint(0, 128, (context - b,)) for b in range(batch)]  # ragged rows
    cache, logits = prefill(model, prompts, max_new_tokens=4)
    dec = Decoder(model, cache, cuda_graph=False)
    ids = logits.argmax(-1, keepdim=True)  # [B, 1]
    ids = dec.step(ids).argmax(-1, keepdim=True)  # warm step (lazy per-step caches are built here)
    counter = OpCounter()
    layers = model.model.layers
    handles = []
    for l, layer in enumerate(layers):
        def enter(mod, args, l=l):
            counter.scope = f"layer {l}"

        def leave(mod, args, out):
            counter.scope = "outside"

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        with counting(counter):
            dec.step(ids)
    finally:
        for h in handles:
            h.remove()
    return counter.counts


def summarize(counts: dict[str, Counter]) -> dict:
    """Per-layer kernel ops (mean over layers), their names, the outside ops, and view ops."""
    layer_keys = [k for k in counts if k.startswith("layer")]
    per_layer = Counter()
    for k in layer_keys:
        per_layer.update(counts[k])
    n = max(len(layer_keys), 1)
    kern = {op: c / n for op, c in per_layer.items() if op not in VIEW_OPS}
    views = {op: c / n for op, c in per_layer.items() if op in VIEW_OPS}
    out = counts.get("outside", Counter())
    return dict(per_layer=sum(kern.values()), per_layer_ops=dict(sorted(kern.items(), key=lambda kv: -kv[1])),
                per_layer_views=sum(views.values()),
                outside=sum(c for op, c in out.items() if op not in VIEW_OPS),
                outside_ops=dict(sorted(((op, c) for op, c in out.items() if op not in VIEW_OPS),
                                        key=lambda kv: -kv[1])))


def layer_ops(model, batch: int = 1, context: int = 16) -> float:
    """Kernel ops per layer per decode step (mean over layers, views excluded): the number a test pins."""
    return summarize(count_step(model, batch, context))["per_layer"]
