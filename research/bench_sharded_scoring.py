"""Sharded receiver scores: N processes against one, the same scores, the wall-time speed-up.

    # 2 GPUs of one host (device kind nvidia-h200-x2): Qwen3-1.7B-shaped random model, bf16, 2 pairs of 4096 tokens
    python research/bench_sharded_scoring.py --world 1,2 --out runs/bench_sharded        # JSON to --out and $OUT
    # CPU (gloo, one thread per process), a small shape: the same code path, measured on this machine's cores
    python research/bench_sharded_scoring.py --device cpu --shape small --world 1,2

For each world size N the script starts `torchrun --standalone --nproc_per_node N` on itself (``--worker``);
every rank builds the same seeded model and pairs, scores them with ``headscope.patching.receiver_scores``
(the fast HF backend; ``shard=None`` for one process, else ``--modes``), and rank 0 writes its timing and
scores. Timed: the scoring call only (model build and a warm-up pair excluded), on every rank between two
barriers. The driver then prints, per mode, seconds, speed-up over one process and the largest score
difference. Target: >= 1.8x on 2 GPUs with the same scores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from headscope.io import write_text
from headscope.synthetic import QWEN3_1_7B

SHAPES = {  # headscope.synthetic.QWEN3_1_7B: 28 layers, 16 query / 8 KV heads of 128, hidden 2048, MLP 6144
    "qwen3-1.7b": dict(QWEN3_1_7B, seq=4096, first_diff=2048, answer=4),
    "small": dict(layers=6, heads=8, kv_heads=4, head_dim=32, hidden=256, intermediate=768, vocab=2048, seq=512,
                  first_diff=256, answer=4),
}


def build(shape: dict, n_pairs: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The seeded random Qwen3 of ``shape`` and ``n_pairs`` pairs whose answers the corruption moves most."""
    from headscope.patching import as_patch_pair
    from headscope.synthetic import moved_answer_pair, random_qwen3

    model = random_qwen3(shape, device=device, dtype=dtype, seed=seed,
                         max_position_embeddings=max(40960, shape["seq"]))
    g = torch.Generator().manual_seed(seed)
    pairs = [as_patch_pair(moved_answer_pair(model, shape["seq"], shape["first_diff"], shape["answer"], g))
             for _ in range(n_pairs)]
    return model, pairs


def worker(args) -> None:
    import torch.distributed as dist

    from headscope.metrics import resolve_metric
    from headscope.patching import HFBackend, receiver_scores
    from headscope.patching.sharded import end_process_group, init_from_env

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}") if args.device == "cuda" else torch.device("cpu")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    sharded = init_from_env(device)
    rank = dist.get_rank() if sharded else 0
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, pairs = build(SHAPES[args.shape], args.pairs + 1, device, dtype)
    backend, metric = HFBackend(model), resolve_metric("logit_diff")
    receiver_scores(backend, pairs[:1], metric, progress=False, min_clean_accuracy=0.0)  # warm-up (kernels, batch)
    results = {}
    for mode in (args.modes.split(",") if sharded else ["none"]):
        if sharded:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        s = receiver_scores(backend, pairs[1:], metric, progress=False, min_clean_accuracy=0.0,
                            shard=None if mode == "none" else mode)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if sharded:
            dist.barrier()
        results[mode] = {"seconds": time.perf_counter() - t0, "raw": s.per_sample_raw.tolist(),
                         "mode": s.settings.get("shard", "none")}
    if rank == 0:
        info = {"world": dist.get_world_size() if sharded else 1, "device": args.device,
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                "shape": args.shape, "pairs": args.pairs, "dtype": str(dtype), "torch": torch.__version__,
                "threads_per_process": args.threads if args.device == "cpu" else None, "results": results}
        write_text(args.worker, json.dumps(info))
    end_process_group()  # a barrier first: rank 0's file is written before any rank leaves


def drive(args) -> dict:
    worlds = [int(w) for w in args.world.split(",")]
    if worlds[0] != 1:
        raise SystemExit("--world must start with 1 (the baseline)")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in worlds:
            out = Path(tmp) / f"world{n}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                   __file__, "--worker", str(out), "--device", args.device, "--shape", args.shape,
                   "--pairs", str(args.pairs), "--modes", args.modes, "--threads", str(args.threads)]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"world {n} failed:\n{proc.stderr[-4000:]}")
            runs[n] = json.loads(out.read_text())
            runs[n]["wall_with_startup_s"] = time.perf_counter() - t0
    base = runs[1]["results"]["none"]
    ref = torch.tensor(base["raw"])  # [N, L, H]
    summary = {"shape": args.shape, "device": args.device, "gpu": runs[1]["gpu"], "pairs": args.pairs,
               "one_process_s": base["seconds"], "rows": []}
    print(f"one process: {base['seconds']:.2f} s for {args.pairs} pair(s) ({args.shape}, {args.device})")
    for n in worlds[1:]:
        for mode, r in runs[n]["results"].items():
            diff = float((torch.tensor(r["raw"]) - ref).abs().max())
            row = {"world": n, "mode": mode, "seconds": r["seconds"], "speedup": base["seconds"] / r["seconds"],
                   "max_abs_score_diff": diff, "scale": float(ref.abs().max())}
            summary["rows"].append(row)
            print(f"{n} processes, shard={mode}: {r['seconds']:.2f} s, speed-up {row['speedup']:.2f}x, largest score "
                  f"difference {diff:.2e} (largest score {row['scale']:.2f})")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default=None, choices=list(SHAPES), help="default: qwen3-1.7b on cuda, small on cpu")
    p.add_argument("--world", default="1,2", help="process counts, the first 1 (default 1,2)")
    p.add_argument("--pairs", type=int, default=2, help="pairs scored (after one warm-up pair); default 2")
    p.add_argument("--modes", default="heads,samples", help="shard modes timed in the multi-process runs")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process (--device cpu)")
    p.add_argument("--out", default=None, help="folder for bench_sharded_scoring.json (also $OUT when set)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.shape = args.shape or ("qwen3-1.7b" if args.device == "cuda" else "small")
    if args.worker:
        return worker(args)
    summary = drive(args)
    for folder in filter(None, [args.out, os.environ.get("OUT")]):
        Path(folder).mkdir(parents=True, exist_ok=True)
        write_text(Path(folder) / "bench_sharded_scoring.json", json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
