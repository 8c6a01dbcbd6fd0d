"""The trainer's own step rate: ``hybrid.train.run`` on a config, then each stage's tokens/s from its log (the
median of the log records after the first, compiling step) and the model-FLOPs MFU, counted as
``run.py --throughput-only`` counts it (``research.perf.throughput``: student forward x 3, plus the teacher's forward
in the hybrid stages; of the H200's 790 TFLOP/s bf16 peak).

    python research/train_hybrid/trainer_throughput.py --config research/train_hybrid/smollm2_stage2_speed.toml \
        [--mask MASK.json] [--out DIR] [--device cpu]

Prints one line per stage and writes ``OUT/trainer_throughput.json``. A stage name may repeat (e.g. "align" at two
batch sizes, ``smollm2_stage1_speed.toml``): each stage is read by its place in the config.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--mask", default=None, help="override the config's mask path")
    ap.add_argument("--out", default=None, help="override the config's output folder")
    ap.add_argument("--device", default=None)
    a = ap.parse_args(argv)

    from headscope.io import write_text
    from hybrid.train import TrainConfig, Trainer
    from hybrid.train.logs import read_log
    from hybrid.train.stages import STAGES
    from research.perf.throughput import H200_BF16_PEAK, forward_flops_per_token

    overrides = {k: v for k, v in (("mask", a.mask), ("out", a.out), ("device", a.device)) if v is not None}
    cfg = TrainConfig.from_file(a.config, **overrides)
    trainer = Trainer(cfg)  # what hybrid.train.run does, keeping the trainer: its loaded teacher is counted below
    import torch

    try:
        trainer.run("all", resume=False, allow_config_change=False)
        out_of_memory = None
    except torch.OutOfMemoryError as err:  # the stages logged before it are still read (a size sweep's last stage)
        out_of_memory = str(err).splitlines()[0]
        print(f"out of memory (the stages before it are read from the log): {out_of_memory}")
    student, teacher = trainer.student, trainer.teacher
    records = [r for r in read_log(Path(cfg.out) / "log.jsonl") if "tok_per_s" in r]
    rows = []
    repeated = len({st.name for st in cfg.stages}) < len(cfg.stages)
    for index, st in enumerate(cfg.stages):
        mine = [r for r in records if r.get("stage_index", index) == index and r["stage"] == st.name]
        tps = [r["tok_per_s"] for r in mine]
        label = f"{st.name} (schedule entry {index + 1})" if repeated else st.name
        if not tps:
            why = "it ran out of memory, or did not start" if out_of_memory else "log_every larger than the steps run?"
            print(f"{label}: no log records with tokens/s ({why})")
            continue
        T, kind, med = st.seq_len, STAGES[st.name], statistics.median(tps)
        flops = None  # align trains the new parameters only: its backward is not 2x the forward; not counted
        if kind.trains == "all":  # forward + backward of every weight (3x), plus the teacher's forward if it runs
            flops = 3 * forward_flops_per_token(student, T)
            if kind.uses_teacher and teacher is not None:  # on the first P tokens of a row (long_distill), else all
                P = min(T, (kind.for_teacher(st, teacher) if kind.for_teacher else st).kl_positions or T)
                flops += forward_flops_per_token(teacher, P) * P / T
        row = {"stage": st.name, "stage_index": index, "batch_size": st.batch_size,
               "micro_batch_size": st.micro_batch_size or st.batch_size, "seq_len": T,
               "log_records": len(tps),
               "steps": max(r["step"] for r in mine), "tok_per_s_median": med, "tok_per_s_min": min(tps),
               "tok_per_s_max": max(tps), "model_flops_per_token": flops,
               "tflops": round(med * flops / 1e12, 2) if flops else None,
               "mfu": med * flops / H200_BF16_PEAK if flops else None,
               "gpu_mem_gib": max((r.get("gpu_mem_gib") or 0) for r in mine) or None}
        rows.append(row)
        rate = (f", {row['tflops']} TFLOP/s = MFU {row['mfu']:.1%} of {H200_BF16_PEAK / 1e12:.0f}" if flops else
                " (MFU not counted: only the new parameters train)")
        passes = f" in passes of {st.micro_batch_size}" if st.micro_batch_size else ""
        mem = f", peak {row['gpu_mem_gib']} GiB" if row["gpu_mem_gib"] else ""
        print(f"{label}: batch {st.batch_size} x {T}{passes}, {row['steps']} steps: {med:,.0f} tokens/s (median of "
              f"{len(tps)} log records, {min(tps):,.0f}-{max(tps):,.0f}){rate}{mem}")
    write_text(Path(cfg.out) / "trainer_throughput.json",
               json.dumps({"config": a.config, "rows": rows, "out_of_memory": out_of_memory}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
