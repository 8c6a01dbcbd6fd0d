"""Kernel timings on the GPU (bf16, batch 1, median ms): fla GDN chunk forward and forward+backward for 14 heads
of dim 128, and causal SDPA for 2 heads (MHA) and 16 heads (GQA, 8 KV heads) of dim 128, at T = 4K..128K.

Run (GPU machine): pip install --no-index --find-links .whl fla-core==0.6.0
                   python research/bench_kernels_gpu.py
Writes $OUT/bench_kernels.json when OUT is set. GDN fwd+bwd rows: "fla" = fla's own backward (guard bypassed on
Hopper + Triton < 3.7.1, for timing only), "dispatch" = what our gated_delta_rule runs for training there (the
torch-chunk recompute backward unless the head dim is verified). `--cpu-twins` instead times the PyTorch chunked
twin against the recurrent loop on CPU (the numbers in docs/kernels.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from hybrid.ops import attention, gated_delta_rule
from hybrid.ops.gdn import fla_available, hopper_backward_guarded
from hybrid.ops.gdn_chunk import chunk_gated_delta_rule as torch_chunk
from hybrid.ops.gdn_recurrent import recurrent_gated_delta_rule as torch_recurrent


def bench_ms(fn, grad_to_none=None, rep_ms: int = 200) -> float:
    """Median milliseconds (triton.testing.do_bench; CUDA events as fallback)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"))
    except ImportError:
        fn()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def gdn_rows(T: int, H: int = 14, D: int = 128) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(generator=gen, device="cuda")
    q = torch.randn(1, T, H, D, **kw).bfloat16().requires_grad_()  # [B, T, H, D]
    k = torch.randn(1, T, H, D, **kw).bfloat16().requires_grad_()  # [B, T, H, D]
    v = torch.randn(1, T, H, D, **kw).bfloat16().requires_grad_()  # [B, T, H, D]
    g = F.logsigmoid(torch.rand(1, T, H, **kw)).requires_grad_()  # [B, T, H]
    beta = torch.rand(1, T, H, **kw).sigmoid().bfloat16().requires_grad_()  # [B, T, H]
    do = torch.randn(1, T, H, D, **kw).bfloat16()  # [B, T, H, D]
    leaves = [q, k, v, g, beta]
    rows = []

    def fwd():
        with torch.no_grad():
            gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend="fla_chunk")

    rows.append(dict(op="gdn fla_chunk fwd", H=H, T=T, ms=bench_ms(fwd)))
    guarded = hopper_backward_guarded()
    for label, allow in (("fla", True), ("dispatch", False)) if guarded else (("fla", False),):
        def fwd_bwd(allow=allow):
            o, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend="fla_chunk",
                                    allow_unverified_hopper_backward=allow)
            o.backward(do)

        try:
            ms = bench_ms(fwd_bwd, grad_to_none=leaves, rep_ms=200 if label == "fla" else 50)
        except torch.OutOfMemoryError:
            ms = float("nan")
            torch.cuda.empty_cache()
        rows.append(dict(op=f"gdn fla_chunk fwd+bwd ({label} backward)", H=H, T=T, ms=ms))
    return rows


def sdpa_rows(T: int, H: int, K: int, D: int = 128) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(generator=gen, device="cuda")
    q = torch.randn(1, T, H, D, **kw).bfloat16().requires_grad_()  # [B, T, H, D]
    k = torch.randn(1, T, K, D, **kw).bfloat16().requires_grad_()  # [B, S, K, D]
    v = torch.randn(1, T, K, D, **kw).bfloat16().requires_grad_()  # [B, S, K, D]
    do = torch.randn(1, T, H, D, **kw).bfloat16()  # [B, T, H, D]

    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    def fwd():
        with torch.no_grad(), sdpa_kernel(fused):  # never the math backend: it would materialise [T, T] scores
            attention(q, k, v, backend="sdpa")

    def fwd_bwd():
        with sdpa_kernel(fused):
            attention(q, k, v, backend="sdpa").backward(do)

    rows = []
    for mode, fn, grads in (("fwd", fwd, None), ("fwd+bwd", fwd_bwd, [q, k, v])):
        try:
            ms = bench_ms(fn, grad_to_none=grads)
        except (RuntimeError, torch.OutOfMemoryError) as err:
            print(f"sdpa {mode} H={H} K={K} T={T} failed: {str(err).splitlines()[0]}", flush=True)
            ms = float("nan")
            torch.cuda.empty_cache()
        rows.append(dict(op=f"sdpa causal {mode} (KV heads {K})", H=H, T=T, ms=ms))
    return rows


def cpu_twin_rows(lengths: list[int], H: int = 4, D: int = 64) -> list[dict]:
    """PyTorch chunked twin vs the recurrent loop on CPU (float32, forward, and forward+backward; best of 3)."""
    rows = []
    for T in lengths:
        x = [torch.randn(1, T, H, D), F.normalize(torch.randn(1, T, H, D), dim=-1), torch.randn(1, T, H, D),
             F.logsigmoid(torch.randn(1, T, H)), torch.rand(1, T, H)]
        for name, fn in (("torch_chunk", torch_chunk), ("torch_recurrent", torch_recurrent)):
            for mode in ("fwd", "fwd+bwd"):
                if name == "torch_recurrent" and mode == "fwd+bwd" and T > 1024:
                    continue  # minutes per call on CPU
                leaves = [t.clone().requires_grad_(mode == "fwd+bwd") for t in x]
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    o, _ = fn(*leaves)
                    if mode == "fwd+bwd":
                        o.sum().backward()
                    times.append(1e3 * (time.perf_counter() - t0))
                rows.append(dict(op=f"gdn {name} {mode} (cpu, fp32, H={H}, D={D})", H=H, T=T, ms=min(times)))
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    ap.add_argument("--cpu-twins", action="store_true", help="time the PyTorch twins on CPU instead")
    args = ap.parse_args()
    if args.cpu_twins:
        rows = cpu_twin_rows(args.lengths if args.lengths != ap.get_default("lengths") else [256, 1024, 4096])
    else:
        if not (torch.cuda.is_available() and fla_available()):
            sys.exit("needs CUDA and fla (pip install --no-index --find-links .whl fla-core==0.6.0 pytest)")
        print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
              f"fla Hopper guard applies: {hopper_backward_guarded()}")
        rows = []
        for T in args.lengths:
            rows += gdn_rows(T)
            rows += sdpa_rows(T, H=2, K=2)
            rows += sdpa_rows(T, H=16, K=8)
            for r in rows[-6:]:
                print(r, flush=True)
            torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    table = df.pivot_table(index="op", columns="T", values="ms", aggfunc="first", sort=False)
    with pd.option_context("display.width", 200, "display.float_format", "{:.2f}".format):
        print("\nmedian ms (batch 1, bf16, head dim 128)" if not args.cpu_twins else "\nms (best of 3)")
        print(table.to_string())
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        name = "bench_kernels_cpu.json" if args.cpu_twins else "bench_kernels.json"
        (Path(out) / name).write_text(json.dumps(rows, indent=1))
        print(f"wrote {out}/{name}")


if __name__ == "__main__":
    main()
