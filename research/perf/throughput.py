"""Stage-2 (distillation) throughput: tokens/s and model FLOPs utilisation (MFU).

Model FLOPs per token, forward: 2 x (inputs x outputs) of every ``nn.Linear`` (lm_head included), plus the
attention cores: softmax heads 4 x D x (T + 1) / 2 (QK^T and AV over the causal average of (T + 1) / 2 keys),
Gated DeltaNet heads 6 x D^2 (state read k^T S, rank-one write, output q^T S; the chunked form's
intra-chunk terms are left out, so the count is a lower bound). A stage-2 step costs the student's forward and
backward (3x forward) plus the teacher's forward (1x). MFU = tokens/s x FLOPs/token / peak (H200 bf16 dense:
790 TFLOP/s).

``profile=True`` adds where a step's time goes (``profile_step``): torch.profiler over two more steps, the device
kernels (CPU ops without a GPU) summed by category (``KERNEL_CATEGORIES``: matmul, gdn, attention, loss, norm,
elementwise, optimizer, copy, other) and the top kernels by self time.
"""
from __future__ import annotations

import re
import time
from typing import Any

import torch
import torch.nn as nn

__all__ = ["H200_BF16_PEAK", "linear_flops_per_token", "attention_flops_per_token", "forward_flops_per_token",
           "measure_distill", "measure_lm", "profile_step", "kernel_category", "KERNEL_CATEGORIES", "compiled_modules",
           "SHAPE_OPS"]

H200_BF16_PEAK = 790e12


def linear_flops_per_token(model: nn.Module) -> float:
    return float(sum(2 * m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear)))


def attention_flops_per_token(model: nn.Module, T: int) -> float:
    """Softmax and GDN core FLOPs per token at length T (see module doc). Hybrid: its FA / GDN branches;
    a Hugging Face teacher: every query head is softmax."""
    from hybrid.layers.hybrid_attention import FullAttentionBranch, GatedDeltaNetBranch

    fa = sum(m.n_heads for m in model.modules() if isinstance(m, FullAttentionBranch))
    gdn = sum(m.n_heads for m in model.modules() if isinstance(m, GatedDeltaNetBranch))
    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if not fa and not gdn:  # a plain transformer
        fa = cfg.num_hidden_layers * cfg.num_attention_heads
    return fa * 4.0 * D * (T + 1) / 2 + gdn * 6.0 * D * D


def forward_flops_per_token(model: nn.Module, T: int) -> float:
    return linear_flops_per_token(model) + attention_flops_per_token(model, T)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _utilisation(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    try:
        return float(torch.cuda.utilization(device))
    except Exception:  # needs pynvml / NVML
        return None


# first match wins; names of CUDA kernels (cuBLAS / CUTLASS / Triton / ATen) and, on CPU, of aten ops
KERNEL_CATEGORIES: list[tuple[str, str]] = [
    ("optimizer", r"adam|multi_tensor_apply|_foreach"),
    ("gdn", r"chunk_gated_delta|gated_delta|chunk_fwd|chunk_bwd|chunk_scaled_dot|solve_tril|wy_fast|"
            r"chunk_local_cumsum|recompute_w_u|wy_repr|fused_recurrent|prologue|_gdn|l2norm|kkt"),
    ("attention", r"flash|fmha|sdpa|scaled_dot_product|attention|cudnn_.*(mha|attn)"),
    ("loss", r"softmax|cross_entropy|nll_loss|kl_div|logsumexp|fused_distill|_lse"),
    ("matmul", r"gemm|matmul|\bmm\b|addmm|bmm|cutlass|xmma|nvjet|sm90_|sm80_|cublas|linear"),
    ("norm", r"rms_?norm|layer_?norm|_norm_"),
    ("copy", r"memcpy|memset|copy_|_to_copy|cat_|catarray|index|gather|scatter"),
    ("elementwise", r"elementwise|vectorized|reduce|unrolled|silu|mul|add|pow|sqrt|exp|sum|mean|where|fill|div|"
                    r"lerp|sub|neg|clamp|sigmoid|softplus|tanh"),
]


def _is_annotation(name: str) -> bool:
    """A named range, not a kernel: torch.compile's "## Call CompiledFxGraph <key> ##" (and any record_function
    range) appears on the GPU timeline too, spanning kernels that are counted on their own; counting both made
    the H200 profiles' "other" category 45% of the kernel time."""
    return (name.startswith("## ") and name.endswith(" ##")) or name.startswith("ProfilerStep#")


def kernel_category(name: str) -> str:
    """The ``KERNEL_CATEGORIES`` entry whose pattern matches ``name`` first (case-insensitive), else "other"."""
    low = name.lower()
    for cat, pattern in KERNEL_CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


# the aten ops whose kernels profile_step attributes by input dtypes and shapes (``ops_top``): the elementwise and
# copy work that is not matmul, attention or GDN (eager ops; a compiled region's fused kernels are not aten ops)
SHAPE_OPS = ("aten::add", "aten::add_", "aten::copy_", "aten::mul", "aten::mul_", "aten::sum", "aten::div",
             "aten::sub", "aten::exp", "aten::where", "aten::fill_", "aten::zero_", "aten::cat")


_NOT_WHERE = ("torch/", "research/perf/throughput.py")  # frames that do not say where an op comes from


_PY_FRAME = re.compile(r".+\.py\(\d+\): ")  # how the profiler names a Python frame: "path.py(12): function"


def _is_ours(frame: str) -> bool:
    return bool(_PY_FRAME.match(frame)) and not any(m in frame for m in _NOT_WHERE) and not frame.startswith("<")


def _where(e) -> str:
    """The innermost Python frame above the op ``e`` that is not torch's (profiled with_stack), or "": its parents
    that are Python function events (``is_python_function``, torch >= 2.12; older versions name them "f.py(n): g"),
    else the op's own recorded ``stack`` (innermost first)."""
    p = e.cpu_parent
    while p is not None:
        if getattr(p, "is_python_function", True) and _is_ours(p.name):
            return p.name
        p = p.cpu_parent
    return next((f for f in (getattr(e, "stack", None) or []) if _is_ours(f)), "")


def _ops_by_shape(prof, cuda: bool, steps: int, top: int) -> list[dict[str, Any]]:
    """The ``SHAPE_OPS`` events grouped by (op, input dtypes, input shapes, the innermost Python frame above it
    that is not torch's: ours, fla's, or "" for the autograd engine's own ops): the kernel time they launched
    (CUDA) or their self CPU time, per step."""
    agg: dict[tuple, list] = {}
    for e in prof.events():
        if e.name not in SHAPE_OPS:
            continue
        us = float(getattr(e, "self_device_time_total", 0.0) or 0.0) if cuda else float(e.self_cpu_time_total)
        if us <= 0:
            continue
        where = _where(e)
        dtypes = [t for t in (getattr(e, "input_dtypes", None) or []) if t and t != "Scalar"][:2]
        key = (e.name, str(dtypes), str([s for s in (e.input_shapes or []) if s][:2]), where)
        a = agg.setdefault(key, [0.0, 0])
        a[0] += us
        a[1] += 1
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"op": k[0], "dtypes": k[1], "shapes": k[2], "where": k[3][:160], "ms": round(v[0] / 1e3 / steps, 3),
             "calls": v[1] // steps} for k, v in rows]


def profile_step(step, device: torch.device, steps: int = 2, top: int = 25, shapes: bool = True) -> dict[str, Any]:
    """Run ``step`` ``steps`` times under torch.profiler: self time per category (ms per step and share) and the
    ``top`` kernels. On CUDA only device kernels count (their self CUDA time); on CPU, the aten ops' self CPU
    time. ``step_ms``: the profiled wall time per step (profiling slows it a little). On CUDA also the host side:
    ``kernels_per_step`` (launches), ``host_ms_per_step`` (self CPU time of every CPU-side event: ops, CUDA runtime
    calls, compiled regions; inflated by the profiler) and ``host_top``, for a step whose GPU waits on the CPU.
    ``shapes``: also ``ops_top``, the eager elementwise and copy ops (``SHAPE_OPS``) by input dtypes, shapes and the
    project's (or fla's) source line that issued them (the profiler records shapes and stacks: more overhead in
    ``step_ms`` and the host times)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts, record_shapes=shapes, with_stack=shapes) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    wall = (time.perf_counter() - t0) / steps
    rows, host = [], []  # host: on CUDA, the CPU side (ops, launches, compiled regions) by self CPU time
    for e in prof.key_averages():
        if cuda and _is_annotation(e.key):  # a range's mirror on the GPU timeline: its kernels count already
            continue
        if cuda:
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
            if getattr(e, "device_type", None) is not None and "CUDA" not in str(e.device_type):
                if e.self_cpu_time_total > 0:
                    host.append((e.key, float(e.self_cpu_time_total) / 1e3 / steps, int(e.count) // steps))
                continue
        else:
            us = e.self_cpu_time_total
        if us and us > 0:
            rows.append((e.key, float(us) / 1e3 / steps, int(e.count) // steps, kernel_category(e.key)))
    total = sum(r[1] for r in rows) or 1.0
    cats: dict[str, float] = {}
    for _, ms, _, cat in rows:
        cats[cat] = cats.get(cat, 0.0) + ms
    rows.sort(key=lambda r: -r[1])
    host.sort(key=lambda r: -r[1])
    extra = {} if not cuda else {  # where a host-bound step's time goes (profiler overhead included)
        "kernels_per_step": sum(r[2] for r in rows),
        "host_ms_per_step": round(sum(r[1] for r in host), 2),
        "host_top": [{"name": n[:160], "ms": round(ms, 3), "calls": c} for n, ms, c in host[:top]]}
    if shapes:
        extra["ops_top"] = _ops_by_shape(prof, cuda, steps, top)
    return {"timer": "self CUDA time of device kernels" if cuda else "self CPU time of aten ops",
            "step_ms": round(wall * 1e3, 2), "kernel_ms_per_step": round(total, 2), **extra,
            "categories": {k: {"ms": round(v, 2), "share": round(v / total, 4)}
                           for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:160], "category": cat, "ms": round(ms, 3), "calls": c,
                     "share": round(ms / total, 4)} for n, ms, c, cat in rows[:top]]}


def _timed(step, device, warmup: int, steps: int) -> tuple[float, float | None]:
    for _ in range(warmup):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    util = _utilisation(device)
    _sync(device)
    return time.perf_counter() - t0, util


def compiled_modules(model: nn.Module) -> int:
    """How many submodules of ``model`` run ``torch.compile``'d (``nn.Module.compile``): a measurement's
    ``compiled_modules``, 0 for an eager model (and for a plain deepcopy of a compiled one)."""
    from hybrid.train.build import compiled_submodules

    return len(compiled_submodules(model))


def measure_distill(student: nn.Module, teacher: nn.Module, batch_size: int, seq_len: int, steps: int = 10,
                    warmup: int = 3, temperature: float = 1.0, peak: float = H200_BF16_PEAK,
                    fused_loss: str = "auto", profile: bool = False,
                    working_dtype: str = "float32") -> dict[str, Any]:
    """Time ``steps`` stage-2 steps (teacher forward, student forward + backward, AdamW) on random tokens, the
    loss by the trainer's own ``distill_loss`` (kl 1, ce 0.2) with ``fused_loss`` ("auto" / "on" / "off",
    hybrid.train.fused_loss); the row's ``fused`` says which path ran; ``profile``: also ``profile_step``;
    ``working_dtype="bfloat16"``: the student trains with bf16 working weights and float32 masters, as the
    trainer does with that setting (hybrid.train.precision), the masters' update counted in the step."""
    from types import SimpleNamespace

    from hybrid.train.build import copy_model
    from hybrid.train.stages import distill_loss, use_fused_loss

    student = copy_model(student)  # the caller's model is left as it was (compiled layers stay compiled)
    device = next(student.parameters()).device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    V = student.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, V, (batch_size, seq_len), generator=g).to(device)  # [B, T]
    w = torch.ones(batch_size, seq_len, device=device)  # [B, T]
    for p in student.parameters():
        p.requires_grad_(True)
    from hybrid.train.precision import WORKING_DTYPES, MasterWeights

    if working_dtype not in WORKING_DTYPES:
        raise ValueError(f"measure_distill(working_dtype={working_dtype!r}): give one of {sorted(WORKING_DTYPES)}")
    dtype = WORKING_DTYPES[working_dtype]
    mw = MasterWeights(student, dtype) if dtype != torch.float32 else None
    params = [p for _, p in (mw.masters_for(list(student.named_parameters())) if mw else student.named_parameters())]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda" or None)
    student.train()

    cfg = SimpleNamespace(name="distill", kl_weight=1.0, ce_weight=0.2, temperature=temperature,
                          fused_loss=fused_loss)

    def step() -> None:
        terms = distill_loss(cfg, student, teacher, ids, w, autocast)
        loss = sum(wt * total / count for _, wt, total, count in terms)
        opt.zero_grad(set_to_none=True)  # with master weights: the masters' (grads_to_master freed the others)
        loss.backward()
        if mw is not None:
            mw.grads_to_master()
        opt.step()
        if mw is not None:
            mw.master_to_model()

    seconds, util = _timed(step, device, warmup, steps)
    fused = use_fused_loss(cfg, student, teacher, ids)  # after the steps: False where "auto" fell back
    tokens = batch_size * seq_len * steps
    s_f, t_f = forward_flops_per_token(student, seq_len), forward_flops_per_token(teacher, seq_len)
    tps = tokens / seconds
    flops = 3 * s_f + t_f
    prof = {"profile": profile_step(step, device)} if profile else {}
    return {**prof, "kind": "distill", "fused_loss": fused, "compiled_modules": compiled_modules(student),
            "working_dtype": working_dtype,
            "batch_size": batch_size, "seq_len": seq_len, "steps": steps,
            "seconds": round(seconds, 3), "tokens_per_s": round(tps, 1),
            "student_fwd_flops_per_token": s_f, "teacher_fwd_flops_per_token": t_f,
            "model_flops_per_token": flops, "tflops": round(tps * flops / 1e12, 3),
            "mfu": round(tps * flops / peak, 5), "peak_flops": peak, "gpu_utilisation_percent": util}


def measure_lm(model: nn.Module, batch_size: int, seq_len: int, steps: int = 10, warmup: int = 3,
               peak: float = H200_BF16_PEAK, profile: bool = False) -> dict[str, Any]:
    """The teacher's own training step (forward + backward + AdamW, next-token CE), for comparison; ``profile``:
    also ``profile_step``."""
    from hybrid.train.build import copy_model

    device = next(model.parameters()).device
    model = copy_model(model).train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len),
                        generator=torch.Generator().manual_seed(1), device="cpu").to(device)  # [B, T]
    mask = torch.ones_like(ids)  # [B, T]
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda" or None)

    def step() -> None:
        with autocast:
            logits = model(input_ids=ids, attention_mask=mask).logits  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    seconds, util = _timed(step, device, warmup, steps)
    tps = batch_size * seq_len * steps / seconds
    flops = 3 * forward_flops_per_token(model, seq_len)
    prof = {"profile": profile_step(step, device)} if profile else {}
    return {**prof, "kind": "teacher_train", "batch_size": batch_size, "seq_len": seq_len, "steps": steps,
            "seconds": round(seconds, 3), "tokens_per_s": round(tps, 1), "model_flops_per_token": flops,
            "tflops": round(tps * flops / 1e12, 3), "mfu": round(tps * flops / peak, 5), "peak_flops": peak,
            "gpu_utilisation_percent": util}
