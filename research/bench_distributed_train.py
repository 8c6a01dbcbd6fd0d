"""Stage 2 (distill) on 1 process against 2 processes with DDP and with FSDP: the same global batch,
the loss curves side by side, tokens/s and peak GPU memory per process.

    # 2 GPUs of one host (device kind nvidia-h200-x2), the reference teacher, 60 steps of 16 x 2048 tokens:
    python research/bench_distributed_train.py --out runs/bench_dist          # JSON to --out and $OUT
    # CPU (gloo; the same code path, tiny settings; a smoke run, not a result):
    python research/bench_distributed_train.py --device cpu --config research/train_hybrid/tiny.toml \\
        --steps 6 --batch 4 --seq 128 --out /tmp/bench_dist

Each run is `hybrid-train` on a config derived from ``--config``: its "distill" stage only, ``--steps`` steps at
a fixed global batch (no time budget), no evaluations, one checkpoint at the end; 1 process, then
`torchrun --nproc_per_node 2` with ``distributed = "ddp"`` and ``"fsdp"``. The student starts from the same
seeded conversion of the teacher with a fixed mask (``random_global`` at 1/8 of the KV groups, seed 0: a cost
benchmark needs no causal ranking). Printed: the largest relative loss difference to 1 process over the
logged steps, tokens/s after the first step (median of the logged intervals) and its ratio to 1 process, and
``gpu_mem_gib`` (rank 0's peak). Targets: DDP >= 1.8x tokens/s with an equal loss curve; FSDP equal loss,
less memory per GPU than DDP.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from headscope.io import write_text


def make_mask(teacher: str, path: Path) -> None:
    from headscope import load_model
    from headscope.mask import model_shape
    from headscope.selection import select

    import torch

    model, _ = load_model(teacher, device="cpu")
    s = model_shape(model)
    zeros = torch.zeros(s["num_hidden_layers"], s["num_attention_heads"])  # [L, H]: random_global ignores scores
    select(zeros, fraction=1 / 8, strategy="random_global", unit="kv_group", seed=0, model=model).to_json(path)


def derived_config(args, mode: str, out: Path, mask: Path) -> Path:
    from hybrid.train.config import TrainConfig

    d = TrainConfig.from_file(args.config).to_dict()
    distill = [s for s in d["stages"] if s["name"] == "distill"]
    if not distill:
        raise SystemExit(f"{args.config} has no 'distill' stage")
    stage = {**distill[0], "steps": args.steps, "max_minutes": 0.0, "batch_size": args.batch, "seq_len": args.seq,
             "warmup_steps": min(distill[0].get("warmup_steps", 0), args.steps // 4)}
    d.update(stages=[stage], out=str(out / mode), mask=str(mask), eval="none", eval_every=0, checkpoint_every=0,
             log_every=args.log_every, progress=False, distributed="auto" if mode == "one" else mode,
             device=args.device)
    path = out / f"{mode}.json"
    write_text(path, json.dumps(d, indent=1))
    return path


def read(out: Path) -> dict:
    from hybrid.train.logs import read_log

    rows = [r for r in read_log(out / "log.jsonl") if "loss" in r]
    rates = [r["tok_per_s"] for r in rows[1:]]  # the first logged interval holds the first step's compilation
    return {"steps": [r["step"] for r in rows], "loss": [r["loss"] for r in rows],
            "tok_per_s": statistics.median(rates) if rates else None,
            "gpu_mem_gib": max((r["gpu_mem_gib"] for r in rows if "gpu_mem_gib" in r), default=None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="research/train_hybrid/reference.toml")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16, help="global batch (split over the processes)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--modes", default="ddp,fsdp", help="2-process modes after the 1-process run")
    p.add_argument("--out", default="runs/bench_distributed_train")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from hybrid.train.config import TrainConfig

    mask = out / "mask.json"
    make_mask(TrainConfig.from_file(args.config).teacher, mask)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for mode in ["one", *args.modes.split(",")]:
        cfg = derived_config(args, mode, out, mask)
        launch = [sys.executable, "-m", "hybrid.train.cli"] if mode == "one" else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
             "hybrid.train.cli"]
        t0 = time.perf_counter()
        proc = subprocess.run([*launch, "--config", str(cfg)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{proc.stderr[-4000:]}")
        runs[mode] = {**read(out / mode), "wall_s": round(time.perf_counter() - t0, 1)}
    one = runs["one"]
    summary = {"config": args.config, "device": args.device, "steps": args.steps, "global_batch": args.batch,
               "seq_len": args.seq, "runs": runs, "rows": []}
    print(f"1 process: {one['tok_per_s']} tokens/s, peak {one['gpu_mem_gib']} GiB, final loss {one['loss'][-1]:.4f}")
    for mode in args.modes.split(","):
        r = runs[mode]
        if r["steps"] != one["steps"]:
            raise SystemExit(f"{mode}: logged steps {r['steps']} differ from one process's {one['steps']}")
        rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(one["loss"], r["loss"]))
        row = {"mode": mode, "processes": 2, "max_rel_loss_diff": rel, "tok_per_s": r["tok_per_s"],
               "speedup": r["tok_per_s"] / one["tok_per_s"] if one["tok_per_s"] else None,
               "gpu_mem_gib": r["gpu_mem_gib"]}
        summary["rows"].append(row)
        print(f"2 processes, {mode}: {r['tok_per_s']} tokens/s ({row['speedup']:.2f}x), peak {r['gpu_mem_gib']} GiB, "
              f"largest relative loss difference {rel:.2e}")
    for folder in filter(None, [str(out), os.environ.get("OUT")]):
        Path(folder).mkdir(parents=True, exist_ok=True)
        write_text(Path(folder) / "bench_distributed_train.json", json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
