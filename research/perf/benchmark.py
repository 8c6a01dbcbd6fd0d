"""Shared pieces of the GPU benchmark scripts (research/gpu_hybrid_all.py, research/bench_whole_model_gpu.py):
a wall-clock budget with an incrementally rewritten JSON, a median timer, and the one-layer benchmark shape.

    run = Run(budget_s=420, path=Path(os.environ["OUT"]) / "x.json", device="cuda")
    if run.fits("unit", est_s=30): ms = bench_ms(fn, "cuda")
    cfg, hybrid_layer, full_layer = build_layers(shape, "cuda", torch.bfloat16, "auto", "auto")
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from hybrid.config import HybridConfig
from hybrid.decoding import compile_kwargs

__all__ = ["Run", "sync", "bench_ms", "layer_config", "build_layers", "layer_forward_ms"]


class Run:
    """Wall-clock budget, printing and the incrementally rewritten JSON (through headscope.io)."""

    def __init__(self, budget_s: float, path: Path, device: str, **sections) -> None:
        self.t0, self.budget, self.path, self.device = time.time(), budget_s, Path(path), device
        self.data: dict = dict(skipped=[], **sections)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def fits(self, label: str, est_s: float) -> bool:
        """True if a unit estimated to take est_s seconds still fits the budget; else record it as skipped."""
        if self.elapsed() + est_s <= self.budget:
            return True
        self.skip(label, f"elapsed {self.elapsed():.0f} s + est {est_s:.0f} s > budget {self.budget:.0f} s")
        return False

    def skip(self, label: str, why: str) -> None:
        self.data["skipped"].append({"unit": label, "reason": why})
        self.say(f"SKIP {label} ({why})")
        self.save()

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def save(self) -> None:
        from headscope.io import write_text

        self.data["elapsed_s"] = round(self.elapsed(), 1)
        write_text(self.path, json.dumps(self.data, indent=1, default=str))


def inductor_options(items: list[str] | None, mode: str = "default") -> dict:
    """``--inductor KEY=VALUE`` flags as ``Decoder(compile_options=...)``: each value read as JSON where it parses
    (``true``, ``1``, ``"x"``), else as the string; checked against inductor's settings (and ``mode``) by
    ``hybrid.decoding.compile_kwargs`` here, before any model is built. Raises ValueError naming the problem."""
    import json

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--inductor {item!r}: give KEY=VALUE, e.g. --inductor combo_kernels=true")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    compile_kwargs(mode=mode, options=out)
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, device: str, target_ms: float = 250.0, max_reps: int = 20, warmup: int = 1) -> float:
    """Median ms of fn() after ``warmup`` untimed calls (compiles / autotunes the shape); the number of timed
    repetitions adapts so one measurement costs about target_ms (at least 3, or 1 when one call is > 2 s)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for i in range(max_reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
        if (i >= 2 and sum(times) >= target_ms) or (times[0] > 2000 and sum(times) >= target_ms):
            break
    return statistics.median(times)


def layer_config(fa_heads: list[int], shape: dict, **options) -> HybridConfig:
    """A one-layer HybridConfig of the benchmark shape (C, H, K, D, Qwen3 q/k norms, RoPE theta 1e6)."""
    C, H, K, D = shape["C"], shape["H"], shape["K"], shape["D"]
    return HybridConfig(vocab_size=256, hidden_size=C, intermediate_size=4 * C, num_hidden_layers=1,
                        num_attention_heads=H, num_key_value_heads=K, head_dim=D, qk_norm=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, fa_heads=[fa_heads],
                        hybrid=options)


def build_layers(shape: dict, device: str, dtype: torch.dtype, gdn_backend: str, attn_backend: str, **options):
    """(config, hybrid layer with shape["fa_heads"] FA heads, the 16-head full-attention layer), random weights."""
    from hybrid.layers.hybrid_attention import HybridAttention

    hyb_cfg = layer_config(shape["fa_heads"], shape, gdn_backend=gdn_backend, attn_backend=attn_backend, **options)
    full_cfg = layer_config(list(range(shape["H"])), shape, allow_degenerate=True, fa_rope=True, fa_log_scale=False,
                            fa_gate="none", merge="none", attn_backend=attn_backend)
    torch.manual_seed(0)
    hybrid = HybridAttention(hyb_cfg, 0).to(device, dtype)
    full = HybridAttention(full_cfg, 0).to(device, dtype)  # the teacher's attention: RoPE, GQA, q/k norm, o_proj
    for m in (hybrid, full):
        for p in m.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
    return hyb_cfg, hybrid, full


@torch.no_grad()
def layer_forward_ms(layer, cfg: HybridConfig, T: int, device: str, dtype: torch.dtype) -> float:
    """Median forward ms of one attention layer (with projections) on x [1, T, C]."""
    from hybrid.layers.common import RotaryEmbedding

    x = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype) * 0.5  # [B, T, C]
    pos = torch.arange(T, device=device)  # [T]
    cos, sin = RotaryEmbedding(cfg)(pos, dtype)  # [T, D]
    return bench_ms(lambda: layer(x, pos, cos, sin), device)
