"""Decode step times over repeated runs of research/bench_whole_model_gpu.py: each path's mean and spread, the
ratios against the faster teacher, and each step against its bandwidth floor.

    python -m research.perf.decode_table RUN1.json RUN2.json [...] [--bandwidth 4.3e12] [--markdown]
    python -m research.perf.decode_table RUN1.json RUN2.json --kernels COUNT.json --markdown

Paths (columns of a decode row): ``graph`` (the CUDA-graph step, the default path), ``fused_gdn`` (the same with
the fused GDN decode op), ``compiled`` (the ``torch.compile``d step in the graph), ``compiled_fused`` (the
compiled step with the fused GDN decode op), ``hf_static`` (the teacher on transformers' own static cache, compiled:
``--hf-teacher``). The teacher's best is the fastest of its graph, compiled and transformers steps (each the mean
over the runs that have it); every hybrid path's speed-up is against that. The floor is the bytes one step must read, the weights (bf16, the tied embedding read once as the
output head) plus every row's cache at the context (the FA keys/values scale with it, the GDN state does not), at
``--bandwidth`` bytes/s (the H200's 4.8 TB/s peak, ~4.3 TB/s reachable by a copy). The runs must share one
setting (GPU, compile mode, ``--inductor`` settings, ``--pdl``, ``--gemv``): runs that differ are refused, one table a
setting.
Prints one line per (context,
batch, model); ``--markdown`` prints the table for the docs. ``--kernels`` adds the compiled step's kernels per
layer from ``research/count_decode_ops.py --device cuda --compile --fused-gdn --json COUNT.json`` (its tiny model of
the same layer structures, replayed as a CUDA graph): the teacher's, and the 7:1 hybrid's with the fused GDN op (the
split op's when the count has no fused rows, marked so); one layer's own count where the file has it
(``per_layer_marginal``), else the tiny model's total / its layers, marked ``*`` (the kernels outside the layers
shared among two).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

PATHS = ("graph", "fused_gdn", "compiled", "compiled_fused", "hf_static")
HEADERS = {"graph": "graph ms (speed-up)", "fused_gdn": "fused GDN ms", "compiled": "compiled ms",
           "compiled_fused": "compiled + fused ms", "hf_static": "transformers static ms"}  # markdown, per path
TARGETS = {(131072, 8): 5.0, (131072, 1): 2.5, (32768, 1): 1.5}  # speed-up over the teacher, 7:1 hybrid


def load(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"decode_table: cannot read {p}: {e}; pass the bench_whole_model JSON files a GPU run wrote")
        if data.get("dry_run"):
            sys.exit(f"decode_table: {p} is a CPU dry run (a tiny model), not a measurement; pass GPU runs")
        if not data.get("decode"):
            sys.exit(f"decode_table: {p} has no decode rows; run the bench with --sections decode (or all)")
        runs.append(data)
    kinds = {p: setting(d) for p, d in zip(paths, runs)}
    if len(set(kinds.values())) > 1:
        listed = "; ".join(f"{p}: {describe(k)}" for p, k in kinds.items())
        sys.exit(f"decode_table: the runs differ in their setting ({listed}); the table averages repeated runs of "
                 "one setting: pass each setting's runs in a table of their own")
    return runs


def setting(data: dict) -> tuple:
    """What makes two runs' steps different measurements, not repeats: the GPU, the compile mode, inductor's
    settings, programmatic dependent launch and the decode GEMV (``bench_whole_model_gpu --compile-mode /
    --inductor / --pdl / --gemv``)."""
    return (data.get("environment", {}).get("gpu"), data.get("compile_mode") or "default",
            json.dumps(data.get("compile_options") or {}, sort_keys=True), bool(data.get("pdl_used")),
            bool(data.get("gemv")))


def describe(key: tuple) -> str:
    gpu, mode, options, pdl, gemv = key
    return (f"{gpu or 'GPU not recorded'}, compile mode {mode}" + (f", inductor {options}" if options != "{}" else "")
            + (", PDL" if pdl else "") + (", decode GEMV" if gemv else ""))


def floor_ms(data: dict, model: str, context: int, batch: int, bandwidth: float) -> float | None:
    """Bytes a step reads (weights + every row's cache at ``context``) / bandwidth, in ms."""
    cache = next((c for c in data.get("cache_bytes", []) if c["model"] == model), None)
    params = data.get("params", {}).get(model)
    if cache is None or params is None:
        return None
    per_row = cache["fa_kv_bytes"] * context / cache["context"] + cache["gdn_state_bytes"]
    return (2 * params + batch * per_row) / bandwidth * 1e3


def summarize(runs: list[dict], bandwidth: float = 4.3e12) -> list[dict]:
    """One dict per (context, batch, model): mean / spread / count of each path, floor, ratios."""
    cells: dict[tuple, dict[str, list[float]]] = {}
    for data in runs:
        for r in data["decode"]:
            cell = cells.setdefault((r["context"], r["batch"], r["model"]), {p: [] for p in PATHS})
            for p in PATHS:
                if r.get(f"{p}_ms") is not None:
                    cell[p].append(r[f"{p}_ms"])
    out = []
    order = {"teacher": 0, "hybrid_7to1": 1, "layer_3to1": 2}
    for (ctx, batch, model), cell in sorted(cells.items(),
                                            key=lambda kv: (-kv[0][0], -kv[0][1], order.get(kv[0][2], 9), kv[0][2])):
        row = dict(context=ctx, batch=batch, model=model)
        for p, xs in cell.items():
            if xs:
                row[f"{p}_ms"] = statistics.mean(xs)
                row[f"{p}_spread"] = max(xs) - min(xs)
                row[f"{p}_runs"] = len(xs)
        fl = floor_ms(runs[0], model, ctx, batch, bandwidth)
        row["floor_ms"] = fl
        out.append(row)
    for row in out:
        teacher = next((t for t in out if t["model"] == "teacher" and t["context"] == row["context"]
                        and t["batch"] == row["batch"]), None)
        best = min((teacher[f"{p}_ms"], p) for p in PATHS if teacher and f"{p}_ms" in teacher) if teacher else None
        row["teacher_best_ms"], row["teacher_best_path"] = best if best else (None, None)
        for p in PATHS:
            if f"{p}_ms" in row:
                if best:
                    row[f"{p}_speedup"] = best[0] / row[f"{p}_ms"]
                if row["floor_ms"]:
                    row[f"{p}_vs_floor"] = row[f"{p}_ms"] / row["floor_ms"]
    return out


def _len(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _cell(row: dict, p: str) -> str:
    if f"{p}_ms" not in row:
        return "-"
    s = f"{row[f'{p}_ms']:.2f}"
    if row.get(f"{p}_runs", 1) > 1:
        s += f" ± {row[f'{p}_spread'] / 2:.2f}"
    if row["model"] != "teacher" and f"{p}_speedup" in row:
        s += f" ({row[f'{p}_speedup']:.2f}x)"
    return s


KERNEL_MODELS = {"teacher": ("teacher",), "hybrid_7to1": ("hybrid_fused", "hybrid")}  # table -> count_decode_ops


def kernels_per_layer(count: dict, model: str, batch: int) -> str | None:
    """The compiled step's kernels per layer (replayed as a CUDA graph) for a decode-table model at ``batch``, from
    count_decode_ops's JSON: "20" (one layer's own), "24.5*" (total / layers), " (split GDN)" where only the split
    op was counted; None where the count has no such row."""
    for name in KERNEL_MODELS.get(model, ()):
        r = count.get(f"{name} batch {batch} compiled, graph")
        if r is not None:
            v = f"{r['per_layer_marginal']:g}" if "per_layer_marginal" in r else f"{r['per_layer']:g}*"
            return v + (" (split GDN)" if name == "hybrid" else "")
    return None


def load_count(path: str) -> dict:
    try:
        count = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"decode_table: cannot read {path}: {e}; pass the JSON of research/count_decode_ops.py --device cuda "
                 "--compile --fused-gdn --json PATH")
    if not any(k.endswith("compiled, graph") for k in count):
        sys.exit(f"decode_table: {path} has no compiled GPU counts; make it with research/count_decode_ops.py "
                 "--device cuda --compile --fused-gdn --json PATH")
    return count


def markdown(rows: list[dict], count: dict | None = None) -> str:
    cols = ["context, batch", "model", *(HEADERS[p] for p in PATHS), "floor ms", "best / floor"]
    cols += ["compiled kernels / layer"] if count is not None else []
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    shared = False  # some count is the tiny model's total / its layers (marked *)
    for r in rows:
        best = min((r[f"{p}_ms"], p) for p in PATHS if f"{p}_ms" in r)
        vs = f"{best[0] / r['floor_ms']:.2f}x ({best[1]})" if r["floor_ms"] else "-"
        fl = f"{r['floor_ms']:.2f}" if r["floor_ms"] else "-"
        kern = ""
        if count is not None:
            k = kernels_per_layer(count, r["model"], r["batch"])
            shared |= k is not None and "*" in k
            kern = f" {k or '-'} |"
        lines.append(f"| {_len(r['context'])}, {r['batch']} | {r['model']} | "
                     + " | ".join(_cell(r, p) for p in PATHS) + f" | {fl} | {vs} |" + kern)
    if shared:
        lines.append("\n\\* the tiny count model's kernels per step / its layers: the kernels outside the layers "
                     "(embedding, final norm, head) shared among them")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    for (ctx, batch), target in TARGETS.items():
        r = next((x for x in rows if x["model"] == "hybrid_7to1" and x["context"] == ctx and x["batch"] == batch), None)
        if r is None:
            out.append(f"decode {_len(ctx)} batch {batch}: not measured")
            continue
        best = max((r[f"{p}_speedup"], p) for p in PATHS if f"{p}_speedup" in r)
        met = "met" if best[0] >= target else "MISSED"
        out.append(f"decode {_len(ctx)} batch {batch}, 7:1 vs the faster teacher ({r['teacher_best_path']}): {met} "
                   f"({best[0]:.2f}x with {best[1]} vs >= {target:g}x)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_whole_model JSON files (GPU runs)")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the floor (default 4.3e12)")
    ap.add_argument("--markdown", action="store_true", help="print the docs table")
    ap.add_argument("--kernels", default=None, metavar="COUNT.json",
                    help="research/count_decode_ops.py's --json of a GPU count: a kernels-per-layer column")
    args = ap.parse_args(argv)
    if args.bandwidth <= 0:
        ap.error(f"--bandwidth must be > 0 bytes/s, got {args.bandwidth}")
    runs = load(args.runs)
    rows = summarize(runs, args.bandwidth)
    count = load_count(args.kernels) if args.kernels else None
    if args.markdown:
        print(markdown(rows, count))
    else:
        for r in rows:
            print(f"{_len(r['context'])} B={r['batch']} {r['model']}: " + ", ".join(
                f"{p} {_cell(r, p)}" for p in PATHS if f"{p}_ms" in r)
                + (f"; floor {r['floor_ms']:.2f} ms" if r["floor_ms"] else "")
                + (f"; compiled kernels / layer {k}" if count and (k := kernels_per_layer(count, r["model"],
                                                                                         r["batch"])) else ""))
    print(f"{len(runs)} run(s): {describe(setting(runs[0]))}")
    for v in verdicts(rows):
        print(v)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
