"""Time the decode GEMV kernel's tunings against cuBLAS at the decode benchmark's projection shapes (GPU).

    python -m research.perf.gemv_sweep [--rows 1 8] [--shapes all] [--block-n 16 32 64] [--block-k 128 256 512]
        [--num-warps 4 8] [--num-stages 3 4 6] [--bandwidth 4.3e12] [--budget-s 240] [--out FILE] [--dry-run]

One cell per (projection, rows): a projection of the whole-model benchmark's layer
(research/bench_whole_model_gpu.py: hidden 2048, 16 query / 8 KV heads of 128, MLP 6144, vocabulary 151,936; bf16)
applied to a decode step's rows. For F.linear (cuBLAS, what the step runs without ``--gemv``) and every tuning of
``hybrid.ops.gemv.decode_linear_triton`` in the grid (output columns per program x the reduction's tile x Triton's
warps x pipeline stages) it records the median ms (CUDA events), the weight's bytes over that time as GB/s and as a
share of ``--bandwidth`` (the H200's ~4.3 TB/s reachable; an H100's ~3.0), and the largest difference from F.linear
in float32 on the same inputs. It prints cuBLAS's row, the default tuning's and the fastest per cell, and writes
``$OUT/gemv_sweep.json`` (``--out`` to override) after every cell. Each cell gets its share of ``--budget-s`` (what
a cell leaves goes to the next); its later tunings are skipped once that is spent (counted). ``--dry-run`` prints
the cells and the grid and runs nothing (any machine).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybrid.ops.gemv import MAX_ROWS, decode_linear_triton
from research.perf import kernel_sweep
from research.perf.kernel_sweep import keyword_defaults, measure, pick, sweep, time_tunings

C, I, V = 2048, 6144, 151936  # the benchmark's hidden size, MLP width, vocabulary
# (N, K) of each projection: the 7:1 hybrid's fused decode input projection (2 FA query heads, 1 KV head, the FA
# gate, 14 GDN heads' q / k / v and their b / a), the teacher's q / k / v, o_proj, the MLP's, the output head
SHAPES = {"hybrid_in": (256 + 128 + 128 + 256 + 3 * 1792 + 28, C), "teacher_qkv": (4096, C), "o_proj": (C, C),
          "gate_up": (I, C), "down": (C, I), "head": (V, C)}
DEFAULT = keyword_defaults(decode_linear_triton)


def grid(args) -> list[dict]:
    return kernel_sweep.grid(DEFAULT, block_n=args.block_n, block_k=args.block_k, num_warps=args.num_warps,
                             num_stages=args.num_stages)


def cells(args) -> list[tuple[str, int]]:
    return [(name, rows) for name in args.shapes for rows in sorted(args.rows)]


def label(t: dict) -> str:
    return f"block_n {t['block_n']}, block_k {t['block_k']}, warps {t['num_warps']}, stages {t['num_stages']}"


def run_cell(name: str, rows: int, tunings: list[dict], bandwidth: float, deadline: float) -> dict:
    import torch.nn.functional as F

    N, K = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 1, K, device="cuda", dtype=torch.bfloat16, generator=g)  # [rows, 1, K]
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)  # [N, K]
    ref = F.linear(x.float(), w.float())  # [rows, 1, N]
    nbytes = w.numel() * w.element_size()
    cublas = measure(lambda: F.linear(x, w), ref, nbytes, bandwidth)
    out_rows, skipped = time_tunings(lambda t: decode_linear_triton(x, w, **t), tunings, ref, nbytes, bandwidth,
                                     deadline)
    best, default = pick(out_rows, DEFAULT)  # (x and w go with this frame; the allocator reuses their memory)
    return dict(shape=name, n=N, k=K, rows=rows, bytes=nbytes, cublas=cublas, tunings=out_rows, best=best,
                default=default, skipped=skipped)


def line(cell: dict) -> str:
    c, d, b = cell["cublas"], cell["default"], cell["best"]
    return (f"{cell['shape']} [{cell['n']} x {cell['k']}], rows {cell['rows']} ({cell['bytes'] / 1e6:.1f} MB): "
            f"cuBLAS {c['ms']:.4f} ms ({c['of_bandwidth']:.0%})"
            + (f"; default {d['ms']:.4f} ms ({d['of_bandwidth']:.0%})" if d else "; default not timed")
            + (f"; best {b['ms']:.4f} ms ({b['of_bandwidth']:.0%}) with {label(b)}, max err {b['max_abs_err']:.1e}"
               if b else "") + (f"; {cell['skipped']} tunings skipped (budget)" if cell["skipped"] else ""))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8], help=f"rows of x (1..{MAX_ROWS})")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE",
                    help=f"projections, of {', '.join(SHAPES)} (default all)")
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--block-k", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--num-stages", type=int, nargs="+", default=[3, 4, 6])
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s the share is taken of")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="wall-clock budget, shared among the cells; a cell's later tunings are skipped")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/gemv_sweep.json)")
    ap.add_argument("--dry-run", action="store_true", help="print the cells and the grid; run nothing")
    args = ap.parse_args(argv)
    if not all(1 <= r <= MAX_ROWS for r in args.rows):
        ap.error(f"--rows takes 1..{MAX_ROWS} (the kernel's rows), got {args.rows}")
    bad = [b for b in args.block_n + args.block_k if b < 16 or b & (b - 1)]
    if bad:
        ap.error(f"--block-n / --block-k take powers of two >= 16 (tensor-core tiles), got {bad}")
    describe = lambda name, rows: f"{name} {SHAPES[name]}, rows {rows}"
    return sweep("gemv_sweep", args, cells(args), grid(args), describe, label, run_cell, line)


if __name__ == "__main__":
    main()
