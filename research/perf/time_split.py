"""Where a decode step's time goes, by kind of kernel, from ``research/count_decode_ops.py --times N --json F``.

    python -m research.perf.time_split COUNT.json [COUNT_PDL.json ...] [--markdown]

For each timed row (model, batch, path) of each file: the step's time (CUDA events, no profiler), the time some
kernel ran, the rest (no kernel running: launch gaps and the host), and the kernel time split by kind:

    gemm       the projections: cuBLAS / CUTLASS kernels (``nvjet``, ``gemv``, ``gemm``, ``cutlass``) and cuBLAS's
               split-K reductions
    attention  the FA heads' decode attention: the split-KV kernel and its combine
    gdn        the GDN heads' recurrent step: the fused step op's kernel, or fla's recurrent kernel and its helpers
    other      everything else: inductor's fused pointwise / reduction kernels (norms, RoPE, the gate, residual
               adds, cache writes) and any library pointwise kernel

All in microseconds per layer: the row's totals divided by its layers, the kernels outside the layers (embedding,
final norm, output head) spread over them, so a count of few layers overstates "other" a little. Times of the
same file were taken on one GPU one after the other; rows of different files read side by side only where they
name the same GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KINDS = ("gemm", "attention", "gdn", "other")
GEMM_MARKS = ("nvjet", "gemv", "gemm", "cutlass", "splitkreduce")
ATTENTION = ("split_kv", "combine")
GDN = ("step", "fwd")  # the fused op's Triton kernel; fla's recurrent helper


def kind_of(name: str) -> str:
    """The kind of a kernel by its profiler name (``KINDS``)."""
    low = name.lower()
    if any(m in low for m in GEMM_MARKS):
        return "gemm"
    if name in ATTENTION:
        return "attention"
    if name in GDN or low.startswith("fused_recurrent_gated_delta_rule"):
        return "gdn"
    return "other"


def split(row: dict) -> dict:
    """One timed row -> {step, kernels, idle, gemm, attention, gdn, other, kernels_per_layer} per layer (us)."""
    if "step_us" not in row or "time_by_name_us" not in row:
        raise ValueError("a row without times: count with `research.count_decode_ops ... --times N`")
    layers = row["layers"]
    out = dict.fromkeys(KINDS, 0.0)
    for name, us in row["time_by_name_us"].items():
        out[kind_of(name)] += us / layers
    out.update(step=row["step_us"] / layers, kernels=row["busy_us"] / layers,
               idle=max(row["step_us"] - row["busy_us"], 0.0) / layers,
               kernels_per_layer=row.get("per_layer_marginal", row["per_layer"]))
    return out


def rows(path: str) -> list[tuple[str, dict]]:
    """The timed rows of one count file, by their key (e.g. "hybrid_fused batch 1 compiled, graph")."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"time_split: cannot read {path} ({e}); pass the --json file of "
                         "`research.count_decode_ops ... --times N`")
    timed = [(k, split(r)) for k, r in data.items() if isinstance(r, dict) and "step_us" in r]
    if not timed:
        raise SystemExit(f"time_split: {path} has no timed rows; count with `--times N`")
    return timed


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("counts", nargs="+", help="count_decode_ops --times --json files")
    ap.add_argument("--markdown", action="store_true", help="one markdown table")
    ap.add_argument("--all", action="store_true", help="also the eager and unreplayed rows (default: the "
                                                       "replayed ones, the benchmark's paths)")
    args = ap.parse_args(argv)
    table = []
    for path in args.counts:
        for key, s in rows(path):
            if args.all or key.endswith("graph"):
                table.append({"file": Path(path).name, "row": key, **s})
    cols = ("step", "kernels", "idle", *KINDS)
    if args.markdown:
        print("| file | row | " + " | ".join(f"{c} us" for c in cols) + " | kernels / layer |")
        print("|---|---|" + "---:|" * (len(cols) + 1))
        for r in table:
            print(f"| {r['file']} | {r['row']} | " + " | ".join(f"{r[c]:.1f}" for c in cols)
                  + f" | {r['kernels_per_layer']:g} |")
    else:
        for r in table:
            print(f"{r['file']}: {r['row']}: " + ", ".join(f"{c} {r[c]:.1f}" for c in cols)
                  + f" us a layer; {r['kernels_per_layer']:g} kernels a layer")
    sys.stdout.flush()
    return table


if __name__ == "__main__":
    main()
