"""Time the fused GDN decode step kernel's tunings at the decode benchmark's shape (GPU).

    python -m research.perf.gdn_step_sweep [--batches 1 8] [--heads 14] [--block-v 16 32 64 128] [--num-warps 1 2 4 8]
        [--num-stages 1 2 3] [--bandwidth 4.3e12] [--budget-s 120] [--out FILE] [--dry-run]

One cell per (batch, GDN heads): one layer's GDN step of the whole-model benchmark's 7:1 hybrid
(research/bench_whole_model_gpu.py: D = 128, 14 GDN heads a layer, bf16 inputs, a float32 state, the "gdn" decay,
q/k norms on). For every tuning of ``hybrid.ops.gdn_decode.gdn_decode_step_triton`` in the grid (value columns per
program x Triton's warps x pipeline stages) it records the median ms (CUDA events; the state stepped in place at
every call), the bytes a step must move (the state read and written: B x H x D x D x 4 bytes x 2, and the inputs)
over that time as GB/s and as a share of ``--bandwidth``, and the largest difference of one step's output from the
twin's on a fresh copy of the state. It prints the default tuning's row and the fastest per cell and writes
``$OUT/gdn_step_sweep.json`` (``--out`` to override) after every cell. Each cell gets its share of ``--budget-s``
(what a cell leaves goes to the next); its later tunings are skipped once that is spent (counted). ``--dry-run``
prints the cells and the grid and runs nothing (any machine).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybrid.ops.gdn_decode import gdn_decode_step_reference, gdn_decode_step_triton
from research.perf import kernel_sweep
from research.perf.kernel_sweep import keyword_defaults, pick, sweep, time_tunings

D = 128  # head dim of the benchmark shape
DEFAULT = keyword_defaults(gdn_decode_step_triton, ("block_v", "num_warps", "num_stages"))


def grid(args) -> list[dict]:
    return kernel_sweep.grid(DEFAULT, block_v=args.block_v, num_warps=args.num_warps, num_stages=args.num_stages)


def cells(args) -> list[tuple[int, int]]:
    return [(b, h) for b in sorted(args.batches, reverse=True) for h in args.heads]


def label(t: dict) -> str:
    return f"block_v {t['block_v']}, warps {t['num_warps'] or 'default'}, stages {t['num_stages'] or 'default'}"


def inputs(B: int, H: int, device: str = "cuda") -> tuple[tuple, dict]:
    """The step's arguments (bf16 projections as one fused output's views, float32 state) and keywords."""
    g = torch.Generator(device=device).manual_seed(0)
    fused = torch.randn(B, 1, 3 * H * D + 2 * H, device=device, generator=g).to(torch.bfloat16)  # [B, 1, 3HD+2H]
    q, k, v, ba = fused.split([H * D, H * D, H * D, 2 * H], -1)
    q, k, v = (t.view(B, 1, H, D) for t in (q, k, v))  # [B, 1, H, D] views
    b, a = ba.split(H, -1)  # [B, 1, H] views
    state = torch.randn(B, H, D, D, device=device, generator=g) * 0.05  # [B, H, D, D] float32
    w = torch.ones(D, device=device, dtype=torch.bfloat16)  # [D] q / k norm weights
    ang = torch.randn(1, D // 2, device=device, generator=g)
    ang = torch.cat([ang, ang], -1)  # [1, D]
    kw = dict(norm=True, decay="gdn", A_log=torch.zeros(H, device=device), dt_bias=torch.zeros(H, device=device))
    return (q, k, v, b, a, state, w, w, ang.cos(), ang.sin()), kw


def run_cell(B: int, H: int, tunings: list[dict], bandwidth: float, deadline: float) -> dict:
    args, kw = inputs(B, H)
    state0 = args[5].clone()
    ref_state = state0.clone()
    ref = gdn_decode_step_reference(*args[:5], ref_state, *args[6:], **kw).float()  # [B, 1, H, D]
    errors = {}
    for t in tunings:  # one step each on a fresh copy of the state, against the twin's
        try:
            st = state0.clone()
            out = gdn_decode_step_triton(*args[:5], st, *args[6:], **kw, **t)
            errors[tuple(sorted(t.items()))] = max((out.float() - ref).abs().max().item(),
                                                   (st - ref_state).abs().max().item())
        except Exception:  # recorded by time_tunings below
            pass
    scratch = state0.clone()  # the timed calls step this one
    nbytes = 2 * scratch.numel() * 4 + sum(x.numel() * x.element_size() for x in args[:5])
    rows, skipped = time_tunings(lambda t: gdn_decode_step_triton(*args[:5], scratch, *args[6:], **kw, **t),
                                 tunings, None, nbytes, bandwidth, deadline)
    for r in rows:
        r["max_abs_err"] = errors.get(tuple(sorted((k, r[k]) for k in DEFAULT)))
    best, default = pick(rows, DEFAULT)
    return dict(batch=B, heads=H, bytes=nbytes, rows=rows, best=best, default=default, skipped=skipped)


def line(cell: dict) -> str:
    d, b = cell["default"], cell["best"]
    return (f"batch {cell['batch']}, {cell['heads']} GDN heads ({cell['bytes'] / 1e6:.2f} MB): "
            + (f"default {d['ms'] * 1e3:.1f} us ({d['of_bandwidth']:.0%} of bandwidth)" if d else "default not timed")
            + (f"; best {b['ms'] * 1e3:.1f} us with {label(b)}, max err {b['max_abs_err']:.1e}" if b else "")
            + (f"; {cell['skipped']} tunings skipped (budget)" if cell["skipped"] else ""))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--heads", type=int, nargs="+", default=[14], help="GDN heads a layer (the 7:1 hybrid: 14)")
    ap.add_argument("--block-v", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--num-stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s the share is taken of")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="wall-clock budget, shared among the cells; a cell's later tunings are skipped")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/gdn_step_sweep.json)")
    ap.add_argument("--dry-run", action="store_true", help="print the cells and the grid; run nothing")
    args = ap.parse_args(argv)
    if min(args.batches + args.heads) < 1:
        ap.error(f"--batches / --heads take positive integers, got {args.batches} / {args.heads}")
    bad = [b for b in args.block_v if b < 16 or b & (b - 1) or b > D]
    if bad:
        ap.error(f"--block-v takes powers of two from 16 to {D}, got {bad}")
    describe = lambda B, H: f"batch {B}, {H} GDN heads"
    return sweep("gdn_step_sweep", args, cells(args), grid(args), describe, label, run_cell, line)


if __name__ == "__main__":
    main()
