"""Numbers of the evaluation harness on the reference model (docs/evaluation.md).

    python research/bench_evaluate.py --part recorded      # CPU: vs docs/reference_model.md (~15-25 min)
    python research/bench_evaluate.py --part transfer      # CPU: template transfer at 512 and 2040 tokens
    python research/bench_evaluate.py --part long          # CPU: NIAH at 2x, 4x, 8x the training length
    python research/bench_evaluate.py --part smoke         # CPU: the smoke suite, timed (< 60 s)
    python research/bench_evaluate.py --part gpu --device cuda   # the full default suite, timed (H200: < 2 min)
    python research/bench_evaluate.py --part gpu --n-scale 0.1 --set niah.multiples=[0.125,0.25]   # CPU try-out

Every part prints a table and, with --json, writes its rows and timing (headscope.io); the JSON is rewritten
after each evaluation ("partial": true until the end), so a run cut short still leaves what it measured.
Progress: a start and a done line per evaluation and per length, with seconds, on stderr (flushed).
--budget / --time-limit bound the wall time: what is not reached becomes "skipped" rows (note "budget: ...").
Stalls: faulthandler is on (a SIGABRT, e.g. from `timeout -s ABRT`, dumps every thread's Python stack), and
--watchdog S dumps them every S seconds while no evaluation finishes.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import sys
import time

import torch

# docs/reference_model.md, shipped weights: (seed 123, seed 7); the eval's settings are in the comments
RECORDED = {
    "niah_mean@2040": (1.000, 0.991),  # depths 0, 0.1, ..., 1.0, 20 prompts each, teacher-forced exact match
    "niah_worst_depth@2040": (1.000, 0.95),
    "niah_unseen_values@2040": (1.000, 1.000),
    "multikey4@2040": (0.92, 0.94),  # 100 prompts
    "arithmetic": (1.0, 1.0), "binding": (1.0, 1.0), "comparison": (1.0, 1.0), "two_hop": (1.0, 1.0),  # 100 each
    "perplexity@2048": (71.0, 71.0),  # 64 windows of data/corpus/heldout.txt (not shipped; here: the shipped haystack)
}


def part_configs(part: str, n_scale: float, gpu: bool = False) -> tuple[list[str], dict]:
    def n(x):
        return max(1, int(round(x * n_scale)))

    if part == "recorded":
        return ["niah", "niah_multikey", "reasoning", "perplexity"], {
            "niah": {"lengths": (2040,), "n": n(20)},
            "niah_multikey": {"lengths": (2040,), "n_keys": (4,), "n": n(100)},
            "reasoning": {"sizes": (), "n": n(100)},
            "perplexity": {"lengths": (2048,), "n_windows": n(64), "bins": 32}}
    if part == "transfer":
        return ["template_transfer"], {"template_transfer": {"lengths": (512, 2040), "n": n(20)}}
    if part == "long":
        depths = tuple(round(0.1 * i, 1) for i in range(11)) if gpu else (0.0, 0.5, 1.0)  # a CPU takes minutes
        return ["niah"], {"niah": {"lengths": (2040, 4088, 8184, 16376), "depths": depths, "n": n(8 if gpu else 1)}}
    if part == "smoke":
        return ["smoke"], {}
    if part == "gpu":
        if n_scale == 1.0:
            return ["default"], {}
        return ["default"], {"niah": {"n": n(8)}, "niah_multikey": {"n": n(20)}, "template_transfer": {"n": n(20)},
                             "reasoning": {"n": n(50)}, "perplexity": {"n_windows": n(16)}}
    raise SystemExit(f"unknown --part {part!r}")


def report_recorded(df) -> list[tuple[str, float, str]]:
    out = []
    niah = df[(df.evaluation == "niah") & (df.status == "ok")]
    for metric, label in (("accuracy_teacher_forced", "teacher-forced"), ("accuracy", "generation")):
        by_depth = niah[niah.metric == metric].groupby("depth").value.mean()
        out.append((f"niah_mean@2040 ({label})", by_depth.mean(), "niah_mean@2040"))
        out.append((f"niah_worst_depth@2040 ({label})", by_depth.min(), "niah_worst_depth@2040"))
    unseen = niah[niah.metric == "accuracy_unseen_values"]
    if len(unseen):
        out.append((f"niah_unseen_values@2040 (generation, n={int(unseen.n.iloc[0])})", unseen.value.iloc[0],
                    "niah_unseen_values@2040"))
    for metric, label in (("accuracy_teacher_forced", "teacher-forced"), ("accuracy", "generation")):
        mk = df[(df.evaluation == "niah_multikey") & (df.metric == metric)]
        out.append((f"multikey4@2040 ({label})", mk.value.mean(), "multikey4@2040"))
        r = df[(df.evaluation == "reasoning") & (df.metric == metric)]
        for fam, v in r.groupby("family").value.mean().items():
            out.append((f"{fam} ({label})", v, fam))
    ppl = df[(df.evaluation == "perplexity") & (df.metric == "perplexity")]
    out.append(("perplexity@2048 (shipped held-out haystack)", ppl.value.mean(), "perplexity@2048"))
    return out


def environment(device: str) -> str:
    import multiprocessing as mp

    import transformers

    gpu = ""
    if device.startswith("cuda") and torch.cuda.is_available():
        gpu = f", {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return (f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"{os.cpu_count()} CPUs, default start method {mp.get_start_method(allow_none=True) or 'unset'}{gpu}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="recorded", choices=["recorded", "transfer", "long", "smoke", "gpu"])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--n-scale", type=float, default=1.0, help="scale every prompt count (e.g. 0.5 on a busy CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=None,
                    help="spawned processes that build NIAH prompts (default: GPU min(8, cores - 1), CPU 0; shared with this process)")
    ap.add_argument("--set", action="append", default=[], metavar="EVAL.FIELD=VALUE",
                    help="config override as in headscope eval, e.g. niah.multiples=[0.125,0.25] (repeatable)")
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="seconds each evaluation may take (what is not reached: 'skipped' rows, note 'budget: ...')")
    ap.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                    help="seconds the whole evaluation may take (model loading excluded)")
    ap.add_argument("--watchdog", type=float, default=0, metavar="SECONDS",
                    help="dump every thread's stack each SECONDS while no evaluation finishes (0: off)")
    ap.add_argument("--json", default=None, help="write rows, summary and timing here (after each evaluation)")
    ap.add_argument("--out", default=None, help="also write a result folder (headscope eval's format)")
    a = ap.parse_args()

    faulthandler.enable(all_threads=True)  # SIGABRT / SIGSEGV: every thread's Python stack on stderr
    import pandas as pd

    import headscope
    from headscope.evaluate import save_results, summary
    from headscope.evaluate.cli import parse_overrides
    from headscope.io import write_text

    print(f"bench_evaluate --part {a.part}: {environment(a.device)}", file=sys.stderr, flush=True)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    model, tok = headscope.evaluate.load(a.model, device=a.device, dtype=dtype)
    t_load = time.perf_counter() - t0
    print(f"loaded {a.model!r} in {t_load:.1f} s", file=sys.stderr, flush=True)
    suite, configs = part_configs(a.part, a.n_scale, gpu=a.device.startswith("cuda"))
    for name, over in parse_overrides(a.set).items():
        configs[name] = {**configs.get(name, {}), **over}
    if a.watchdog > 0:
        faulthandler.dump_traceback_later(a.watchdog, repeat=True)
    t1 = time.perf_counter()

    def result_of(df, partial: bool) -> dict:
        s = summary(df)
        skipped = df[df.note.fillna("").astype(str).str.startswith("budget:")]
        return {"part": a.part, "partial": partial, "seconds": round(time.perf_counter() - t1, 2),
                "load_seconds": round(t_load, 2), "done": list(df.attrs["meta"]["seconds"]),
                "skipped_for_budget": skipped[["evaluation", "context_length", "family", "note"]]
                .drop_duplicates().to_dict("records"),
                "meta": df.attrs["meta"], "summary": s.to_dict("records")}

    def on_evaluation(name: str, df) -> None:
        if a.watchdog > 0:
            faulthandler.dump_traceback_later(a.watchdog, repeat=True)  # re-armed: progress was made
        if a.json:
            write_text(a.json, json.dumps(result_of(df, partial=True), indent=1, default=str))

    df = headscope.evaluate(model, suite[0] if len(suite) == 1 else suite, tok, configs=configs, seed=a.seed,
                            progress=True, workers=a.workers, budget_s=a.budget, time_limit_s=a.time_limit,
                            on_evaluation=on_evaluation)
    seconds = time.perf_counter() - t1
    faulthandler.cancel_dump_traceback_later()
    s = summary(df)
    with pd.option_context("display.max_rows", 400, "display.width", 200):
        print(s.to_string(index=False))
        bad = df[df.status != "ok"][["evaluation", "metric", "context_length", "status", "note"]]
        if len(bad):
            print(bad.drop_duplicates(["evaluation", "context_length", "note"]).to_string(index=False))
    print(f"\n{a.part}: {seconds:.1f} s of evaluation (+ {t_load:.1f} s loading) on {a.device}, "
          f"per evaluation {df.attrs['meta']['seconds']}")
    result = result_of(df, partial=False)
    if a.part == "recorded":
        print("\nvs docs/reference_model.md (seed 123 / seed 7):")
        rows = report_recorded(df)
        for label, value, key in rows:
            rec = RECORDED.get(key)
            print(f"  {label:<52} {value:8.3f}   recorded {rec[0]:.3f} / {rec[1]:.3f}")
        result["vs_recorded"] = [{"metric": l, "value": v, "recorded": RECORDED.get(k)} for l, v, k in rows]
    if a.json:
        write_text(a.json, json.dumps(result, indent=1, default=str))
    if a.out:
        import importlib.util

        figures = importlib.util.find_spec("plotly") is not None  # a bare GPU machine has none: rows only
        if not figures:
            print("plotly is not installed: the result folder gets no figures", file=sys.stderr)
        save_results(df, a.out, overwrite=True, figures=figures)


if __name__ == "__main__":
    main()
