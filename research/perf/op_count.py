"""Counting the aten ops (~ GPU kernels) of one decode step, per layer (CPU), to keep the decode step lean.

A decode step (one token per row) of a small model on the GPU is bound by how many kernels it launches (each
~2-4 us even replayed from a CUDA graph), so ``count_step`` counts them on the CPU: ops are recorded with a
TorchDispatchMode during one ``hybrid.decoding.Decoder`` step, by scope (``"layer l"`` inside decoder layer l,
``"outside"`` for embedding, begin_step, final norm, lm_head) and op name. Calls that are fused kernels on CUDA
but composites on the CPU count as their CUDA kernels (``FUSED_ON_CUDA``), views and allocations not at all
(``VIEW_OPS``), so ``layer_ops(model)`` approximates the kernels per layer of a CUDA step.
research/count_decode_ops.py prints them for the teacher and the 7:1 hybrid; tests pin an upper bound.

On a GPU, ``count_cuda_kernels`` counts the CUDA kernels one step really launches (torch.profiler, CUDA
activity): eager per layer (record_function ranges around the layers), or the total of a compiled and/or
graph-replayed step; ``graph_breaks`` says where ``torch.compile`` of the step breaks its graph
(``Decoder(compile=True)``, docs/kernels.md). ``research/count_decode_ops.py --device cuda [--compile]``.
"""
from __future__ import annotations

import importlib
from collections import Counter
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "counting", "count_step", "summarize", "layer_ops", "VIEW_OPS", "FUSED_ON_CUDA",
           "count_cuda_kernels", "group_kernels", "graph_breaks", "custom_ops_in"]

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


# ---- CUDA kernels of one decode step (torch.profiler), eager vs compiled, and graph breaks -----------------
def _decoder(model, batch: int, context: int, device, compile: bool, cuda_graph: bool, compile_mode: str,
             compile_backend: str = "inductor", extra_steps: int = 0, compile_options: dict | None = None,
             pdl: bool = False):
    """A prefilled Decoder on ragged random prompts and its next ids [B, 1] (after two warm steps); its cache holds
    8 + ``extra_steps`` new tokens a row."""
    from hybrid.decoding import Decoder, prefill

    torch.manual_seed(1)
    prompts = [torch.randint(0, 128, (context - b,), device=device) for b in range(batch)]  # B x [context - b]
    cache, logits = prefill(model, prompts, max_new_tokens=8 + extra_steps)
    dec = Decoder(model, cache, cuda_graph=cuda_graph, compile=compile, compile_mode=compile_mode,
                  compile_backend=compile_backend, compile_options=compile_options, pdl=pdl)
    ids = logits.argmax(-1, keepdim=True)  # [B, 1]
    for _ in range(2):  # warm steps: lazy per-step caches, compilation, graph capture
        ids = dec.step(ids).argmax(-1, keepdim=True)  # [B, 1]
    return dec, ids


def _scope_of(evt, prefix: str = "decode_layer ") -> str:
    """The innermost enclosing record_function range named ``prefix``+l of a profiler event, else "outside"."""
    e = evt
    while e is not None:
        if e.name.startswith(prefix):
            return "layer " + e.name[len(prefix):]
        e = e.cpu_parent
    return "outside"


def group_kernels(events) -> dict[str, Counter]:
    """Device kernels of profiler ``events`` (FunctionEvents) by scope and kernel name: each CPU event's
    ``kernels`` (the kernels its launches ran, linked by the profiler's correlation ids) under the scope of its
    enclosing "decode_layer l" range; memcpy / memset nodes are named "memcpy" / "memset"."""
    counts: dict[str, Counter] = {}
    for e in events:
        ks = getattr(e, "kernels", None) or []
        if not ks:
            continue
        scope = _scope_of(e)
        for k in ks:
            name = k.name
            low = name.lower()
            name = "memcpy" if low.startswith("memcpy") else "memset" if low.startswith("memset") else name
            counts.setdefault(scope, Counter())[name] += 1
    return counts


def _device_events(events):
    """(event, whether it is a memcpy / memset) for each of the profiler's device-side (CUDA) events."""
    for e in events:
        if getattr(e, "device_type", None) is None or str(e.device_type).split(".")[-1] != "CUDA":
            continue
        yield e, e.name.lower().startswith(("memcpy", "memset"))


def kernel_times(events) -> tuple[float, Counter]:
    """(busy microseconds, microseconds by kernel name) of the profiler's device-side kernels (memcpy / memset
    left out): how long the GPU ran kernels, as against how long the step took (the rest is launch gaps)."""
    busy, times = 0.0, Counter()
    for e, memop in _device_events(events):
        if memop:
            continue
        us = e.time_range.elapsed_us()
        busy += us
        times[e.name] += us
    return busy, times


def step_time_us(dec, ids, steps: int) -> float:
    """Mean microseconds of ``steps`` decode steps timed with CUDA events, outside any profiler."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        dec.step(ids)  # [B, V]
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / steps


def _device_kernel_total(events) -> tuple[int, int, Counter]:
    """(kernels, memcpy/memset nodes, kernels by name) among the profiler's device-side events."""
    kern = mem = 0
    names: Counter = Counter()
    for e, memop in _device_events(events):
        if memop:
            mem += 1
        else:
            kern += 1
            names[e.name] += 1
    return kern, mem, names


@torch.no_grad()
def count_cuda_kernels(model, batch: int = 1, context: int = 16, compile: bool = False, cuda_graph: bool = False,
                       compile_mode: str = "default", steps: int = 3, timed_steps: int = 0,
                       compile_options: dict | None = None, pdl: bool = False) -> dict:
    """CUDA kernels of one decode step (mean over ``steps`` profiled steps), by torch.profiler (CUDA activity).

    Returns dict(total = kernels per step, memops = memcpy/memset per step, per_layer = total / layers,
    by_name = {kernel name: count per step} (every variant, the compiled one's inductor kernels included),
    scoped = {scope: {kernel name: count per step}} and scoped_per_layer = the "layer l" scopes' mean).
    With ``timed_steps``, also where the step's time goes: ``busy_us`` (kernel time per step, from the profiled
    steps), ``time_by_name_us`` (per step, by kernel name, largest first) and ``step_us`` (the step timed with CUDA
    events over ``timed_steps`` steps after the profiled ones, no profiler attached); ``step_us - busy_us`` is time
    the GPU ran no kernel (launch gaps and the host), the part that fewer kernels would save.
    ``compile_options``: inductor's settings for the compiled step (``Decoder(compile_options=...)``); ``pdl``:
    the steps with programmatic dependent launch (``Decoder(pdl=True)``: the same kernels, launched earlier).
    ``scoped``: each decoder layer runs inside a record_function range "decode_layer l" (forward hooks), so the
    kernels that a layer's CPU calls launch are grouped under it; that needs the launches to happen inside the
    range, i.e. an uncaptured step (``cuda_graph=False``). A replayed graph (``cuda_graph=True``) has only the
    total: its kernels run from one graph launch. Under ``compile`` the hooks are not added (they would be
    traced into the compiled graph), so only the total is given."""
    if not torch.cuda.is_available():
        raise RuntimeError("count_cuda_kernels needs a CUDA GPU; on the CPU use count_step (aten ops)")
    from torch.profiler import ProfilerActivity, profile, record_function

    device = next(model.parameters()).device
    dec, ids = _decoder(model, batch, context, device, compile, cuda_graph, compile_mode,
                        extra_steps=steps + timed_steps, compile_options=compile_options, pdl=pdl)
    layers = model.model.layers
    scoped_ok = not cuda_graph and not compile
    handles, ranges = [], {}
    if scoped_ok:
        for l, layer in enumerate(layers):
            def enter(mod, args, l=l):
                ranges[l] = record_function(f"decode_layer {l}")
                ranges[l].__enter__()

            def leave(mod, args, out, l=l):
                ranges.pop(l).__exit__(None, None, None)

            handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                dec.step(ids)  # [B, V]; the same ids each step (only kernels are counted)
            torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    events = prof.events()
    kern, mem, names = _device_kernel_total(events)
    total = kern / steps
    out = dict(total=total, memops=mem / steps, per_layer=total / len(layers), layers=len(layers),
               compile=compile, cuda_graph=cuda_graph, batch=batch,
               by_name={k: c / steps for k, c in names.most_common()})
    if timed_steps:
        busy, times = kernel_times(events)
        out.update(busy_us=busy / steps, time_by_name_us={k: t / steps for k, t in times.most_common()},
                   step_us=step_time_us(dec, ids, timed_steps), context=context)
    if scoped_ok:
        grouped = group_kernels(events)
        out["scoped"] = {s: {k: c / steps for k, c in cnt.items()} for s, cnt in grouped.items()}
        lay = [sum(cnt.values()) / steps for s, cnt in grouped.items() if s.startswith("layer")]
        out["scoped_per_layer"] = sum(lay) / max(len(lay), 1)
    return out


def _short(path: str) -> str:
    """``path`` from the repository root when inside it, else as given."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.relpath(path, root) if os.path.abspath(path).startswith(root + os.sep) else path


def graph_breaks(model, batch: int = 1, context: int = 16) -> dict:
    """Where ``torch.compile`` of the decode step breaks its graph (``torch._dynamo.explain`` of one step on the
    model's device, after one eager step and inside ``trusted_inference_caches()``, as ``Decoder(compile=True)``
    runs it; the cache is restored after each): dict(graphs, breaks, reasons = {(first line of the reason,
    "file:line in function"): count})."""
    import torch._dynamo as dynamo

    from hybrid.layers.common import trusted_inference_caches

    device = next(model.parameters()).device
    dec, ids = _decoder(model, batch, context, device, compile=False, cuda_graph=False, compile_mode="default")
    cache = dec.cache
    cache.full_width = True
    snap = cache.snapshot()
    dynamo.reset()
    with torch.no_grad():
        dec.prime(ids)  # eager: the decode weight caches the compiled step reads
        with trusted_inference_caches():  # as the Decoder's compiled calls
            ex = dynamo.explain(dec._model_step)(ids)
    cache.restore(snap)
    reasons = Counter()
    for b in ex.break_reasons:
        where = b.user_stack[-1] if b.user_stack else None
        loc = f"{_short(where.filename)}:{where.lineno} in {where.name}" if where else "?"
        reasons[(b.reason.strip().split("\n")[0], loc)] += 1
    dynamo.reset()
    return dict(graphs=ex.graph_count, breaks=ex.graph_break_count, reasons=dict(reasons),
                custom_ops=dict(custom_ops_in(ex.graphs)))


def custom_ops_in(graphs) -> Counter:
    """The project's custom ops (``torch.ops.hybrid.*``: the Triton / fla kernels of the CUDA path) called in FX
    ``graphs`` (dynamo's, e.g. ``torch._dynamo.explain(...).graphs``), by name ("hybrid::decode_attention")."""
    found = Counter()
    for g in graphs:
        for node in g.graph.nodes:
            name = getattr(node.target, "name", None)
            if node.op == "call_function" and callable(name):
                name = name()  # OpOverload.name(): "hybrid::decode_attention"
            if node.op == "call_function" and isinstance(name, str) and name.startswith("hybrid::"):
                found[name] += 1
    return found
