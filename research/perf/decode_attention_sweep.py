"""Time the split-KV decode attention kernel's tunings at the decode benchmark's shapes (GPU).

    python -m research.perf.decode_attention_sweep [--contexts 131072 32768] [--batches 8 1] [--kv-heads 1]
        [--block-n 32 64 128] [--waves 1 2 4 8] [--num-warps 4 8] [--num-stages 2 3 4] [--bandwidth 4.3e12]
        [--budget-s 240] [--out FILE] [--dry-run]

One cell per (context, batch, KV heads): one layer's decode attention of the whole-model benchmark's shape
(research/bench_whole_model_gpu.py: D = 128, 2 query heads per KV head, bf16; the 7:1 hybrid keeps 1 KV head per
layer, the teacher 8), every row's cache full to the context. For every tuning of
``hybrid.ops.decode_attention.decode_attention_triton`` in the grid (keys per inner step x programs per SM x
Triton's warps x pipeline stages) it records the median ms (CUDA events; the split and the combine kernel), the
bytes the call must read (the keys and values of every row: B x S x K x D x 2 tensors x 2 bytes) over that time as
GB/s and as a share of ``--bandwidth`` (the H200's ~4.3 TB/s reachable), and the largest difference from the twin
(masked SDPA) on the same inputs. It prints the default tuning's row and the fastest per cell, and writes
``$OUT/decode_attention_sweep.json`` (``--out`` to override) after every cell. Each cell gets its share of
``--budget-s`` (what a cell leaves goes to the next); its later tunings are skipped once that is spent (counted).
``--dry-run`` prints the cells and the grid and runs nothing (any machine).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybrid.ops.decode_attention import decode_attention_triton
from research.perf import kernel_sweep
from research.perf.kernel_sweep import keyword_defaults, pick, sweep, time_tunings

D = 128  # head dim of the benchmark shape (Qwen3-1.7B)
REP = 2  # query heads per KV head (16 query / 8 KV heads)
# decode_attention_triton's tuning keywords and their defaults (what every caller runs)
DEFAULT = keyword_defaults(decode_attention_triton)


def grid(args) -> list[dict]:
    return kernel_sweep.grid(DEFAULT, block_n=args.block_n, waves=args.waves, num_warps=args.num_warps,
                             num_stages=args.num_stages)


def cells(args) -> list[tuple[int, int, int]]:
    """(context, batch, KV heads), longest context and largest batch first."""
    return [(s, b, k) for s in sorted(args.contexts, reverse=True) for b in sorted(args.batches, reverse=True)
            for k in args.kv_heads]


def label(t: dict) -> str:
    return (f"block_n {t['block_n']}, waves {t['waves']}, warps {t['num_warps'] or 'default'}, "
            f"stages {t['num_stages'] or 'default'}")


def run_cell(S: int, B: int, K: int, tunings: list[dict], bandwidth: float, deadline: float) -> dict:
    from hybrid.ops.decode_attention import decode_attention_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 1, K * REP, D, device="cuda", dtype=torch.bfloat16, generator=g)  # [B, 1, H, D]
    k = torch.randn(B, S, K, D, device="cuda", dtype=torch.bfloat16, generator=g)  # [B, S, K, D]
    v = torch.randn(B, S, K, D, device="cuda", dtype=torch.bfloat16, generator=g)  # [B, S, K, D]
    kv_len = torch.full((B,), S, device="cuda", dtype=torch.long)  # [B]
    ref = decode_attention_reference(q, k, v, kv_len).float()  # [B, 1, H, D]
    nbytes = 2 * k.numel() * k.element_size()
    rows, skipped = time_tunings(lambda t: decode_attention_triton(q, k, v, kv_len, **t), tunings, ref, nbytes,
                                 bandwidth, deadline)
    best, default = pick(rows, DEFAULT)  # (q, k, v go with this frame; the allocator reuses their memory)
    return dict(context=S, batch=B, kv_heads=K, bytes=nbytes, rows=rows, best=best, default=default,
                skipped=skipped)


def line(cell: dict) -> str:
    d, b = cell["default"], cell["best"]
    return (f"context {cell['context']}, batch {cell['batch']}, KV heads {cell['kv_heads']} "
            f"({cell['bytes'] / 1e6:.0f} MB): "
            + (f"default {d['ms']:.4f} ms ({d['of_bandwidth']:.0%} of bandwidth)" if d else "default not timed")
            + (f"; best {b['ms']:.4f} ms ({b['of_bandwidth']:.0%}) with {label(b)}, max err {b['max_abs_err']:.1e}"
               if b else "") + (f"; {cell['skipped']} tunings skipped (budget)" if cell["skipped"] else ""))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 1])
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[1], help="1: the 7:1 hybrid's layer; 8: the teacher's")
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--waves", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--num-stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s the share is taken of")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="wall-clock budget, shared among the cells; a cell's later tunings are skipped")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/decode_attention_sweep.json)")
    ap.add_argument("--dry-run", action="store_true", help="print the cells and the grid; run nothing")
    args = ap.parse_args(argv)
    for name in ("contexts", "batches", "kv_heads", "block_n", "waves"):
        if min(getattr(args, name)) < 1:
            ap.error(f"--{name.replace('_', '-')} takes positive integers, got {getattr(args, name)}")
    bad = [b for b in args.block_n if b < 16 or b & (b - 1)]
    if bad:
        ap.error(f"--block-n takes powers of two >= 16, got {bad}")
    describe = lambda S, B, K: f"context {S}, batch {B}, KV heads {K}"
    return sweep("decode_attention_sweep", args, cells(args), grid(args), describe, label, run_cell, line)


if __name__ == "__main__":
    main()
