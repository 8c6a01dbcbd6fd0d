"""What the kernel tuning sweeps share (research/perf/decode_attention_sweep.py, gemv_sweep.py, gdn_step_sweep.py): time
one call per tuning against the bytes it must read, keep going past a tuning Triton cannot build, stop timing at a
deadline, and write the whole result after every cell (a run cut by its time limit keeps its whole cells).

    rows, skipped = time_tunings(lambda t: kernel(x, **t), tunings, ref, nbytes, bandwidth, deadline)
    best, default = pick(rows, default_tuning)
    res = sweep("gemv_sweep", args, todo, tunings, describe, label, run_cell, line)   # a script's main, after argparse
"""
from __future__ import annotations

import inspect
import itertools
import json
import time
from pathlib import Path
from typing import Callable

import torch

from headscope.io import write_text

__all__ = ["keyword_defaults", "grid", "measure", "time_tunings", "pick", "run_cells", "sweep"]


def keyword_defaults(fn: Callable, names: tuple[str, ...] | None = None) -> dict:
    """``fn``'s keyword-only arguments (or just ``names``) and their defaults: the tuning every caller runs."""
    params = inspect.signature(fn).parameters
    names = names or tuple(n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY)
    return {n: params[n].default for n in names}


def grid(default: dict, **choices) -> list[dict]:
    """The tunings to time: ``default`` first, then every combination of ``choices`` (keyword -> values) but it."""
    combos = [dict(zip(choices, values)) for values in itertools.product(*choices.values())]
    return [default] + [c for c in combos if c != default]


def measure(fn: Callable[[], torch.Tensor], ref: torch.Tensor | None, nbytes: int, bandwidth: float,
            device: str = "cuda") -> dict:
    """``fn()`` once (compiles / warms it), then its median ms (CUDA events on "cuda"), the bytes over that time
    as GB/s and as a share of ``bandwidth``, and the largest difference of its output from ``ref`` (float32; None:
    not compared here, e.g. a kernel that steps a state in place, checked by its caller)."""
    from research.perf.benchmark import bench_ms

    out = fn()
    err = None if ref is None else (out.float() - ref).abs().max().item()
    ms = bench_ms(fn, device, target_ms=40.0)
    gbs = nbytes / ms / 1e6
    return dict(ms=round(ms, 4), gb_per_s=round(gbs, 1), of_bandwidth=round(gbs * 1e9 / bandwidth, 3),
                max_abs_err=err)


def time_tunings(call: Callable[[dict], torch.Tensor], tunings: list[dict], ref: torch.Tensor | None, nbytes: int,
                 bandwidth: float, deadline: float, device: str = "cuda") -> tuple[list[dict], int]:
    """One row per tuning (the tuning's keywords and ``measure``'s numbers, or ``error`` for one Triton cannot
    build, e.g. out of shared memory); tunings after ``deadline`` (time.monotonic()) are skipped and counted."""
    rows, skipped = [], 0
    for t in tunings:
        if time.monotonic() > deadline:
            skipped += 1
            continue
        try:
            rows.append(dict(t, **measure(lambda: call(t), ref, nbytes, bandwidth, device)))
        except Exception as e:  # recorded, not fatal
            rows.append(dict(t, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
    return rows, skipped


def pick(rows: list[dict], default: dict) -> tuple[dict | None, dict | None]:
    """The fastest timed row and the default tuning's row (None where none was timed)."""
    ok = [r for r in rows if "ms" in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    return best, next((r for r in ok if all(r[k] == default[k] for k in default)), None)


def run_cells(todo: list, run_cell: Callable, out: Path, header: dict, line: Callable[[dict], str],
              budget_s: float) -> dict:
    """``header`` plus ``cells``: ``run_cell(*cell, deadline)`` for each of ``todo``, the JSON rewritten
    (atomically) after each and ``line(cell)`` printed. Cell i's deadline is its share of ``budget_s`` from the
    start, (i + 1) / len(todo) of it, so that every cell gets its tunings' first ones timed and time a cell leaves
    goes to the next."""
    res = dict(header, cells=[])
    start = time.monotonic()
    for i, cell_args in enumerate(todo):
        cell = run_cell(*cell_args, start + budget_s * (i + 1) / len(todo))
        res["cells"].append(cell)
        write_text(out, json.dumps(res, indent=1))
        print(line(cell), flush=True)
    print(f"wrote {out}")
    return res


def sweep(name: str, args, todo: list, tunings: list[dict], describe: Callable, label: Callable[[dict], str],
          run_cell: Callable, line: Callable[[dict], str]) -> dict:
    """A sweep script's main after its arguments: with ``args.dry_run`` print the cells (``describe(*cell)``) and
    the tunings (``label``) and return them; else refuse a machine without CUDA, and ``run_cells`` with
    ``run_cell(*cell, tunings, args.bandwidth, deadline)`` into ``args.out`` (default $OUT/<name>.json)."""
    import os
    import sys

    if args.dry_run:
        print(f"{len(todo)} cells x {len(tunings)} tunings")
        for cell in todo:
            print(f"  {describe(*cell)}")
        for t in tunings:
            print(f"  {label(t)}")
        return dict(cells=todo, tunings=tunings)
    if not torch.cuda.is_available():
        sys.exit(f"{name}: needs a CUDA GPU with Triton (--dry-run runs anywhere)")
    out = args.out or Path(os.environ.get("OUT", ".")) / f"{name}.json"
    header = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, bandwidth=args.bandwidth,
                  tunings=len(tunings))
    return run_cells(todo, lambda *a: run_cell(*a[:-1], tunings, args.bandwidth, a[-1]), out, header, line,
                     args.budget_s)
