"""What a carried compile cache saves: the first compiled forward + backward of a hybrid's decoder layers
(``hybrid.train.build.compile_decoder_layers``, as the trainer compiles them) in a fresh process, once with empty
caches (a bare machine) and once after ``research.stage_caches.compile_cache_save`` / ``put_compile_cache`` carried
the first run's caches into other, empty folders (a later machine after ``research.stage setup``). Each run is its
own process; the ratio is from one invocation.

    python -m research.perf.compile_cache                     # SmolLM2-135M, the random-KV study mask, 64 tokens
    python -m research.perf.compile_cache --model default --tokens 32 --out compile_cache.json

On the CPU inductor writes C++; on a GPU, Triton kernels (the cache then also holds their binaries).
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

MASK = "docs/results/2026-12-06_smollm2_broad_study_random_kv_h100/mask.json"


def one_step(model_name: str, mask: str | None, tokens: int, device: str) -> dict:
    """(in the child process) seconds of the first and second compiled forward + backward."""
    import torch

    import headscope
    from headscope.mask import HeadMask
    from hybrid.convert import from_mask
    from hybrid.train.build import compile_decoder_layers

    teacher, _ = headscope.load_model(model_name, device=device)
    head_mask = HeadMask.from_json(mask) if mask else None
    if head_mask is None:
        from hybrid.builders import layerwise_mask

        head_mask = layerwise_mask(teacher, "3:1")
    model = from_mask(teacher, head_mask).to(device)
    compile_decoder_layers(model)
    ids = torch.randint(100, 1000, (1, tokens), device=device)  # [1, T]
    out = {}
    for name in ("first_s", "second_s"):
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        out[name] = round(time.perf_counter() - t0, 2)
    return out


def run_child(args: list[str], inductor: Path, triton: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor), TRITON_CACHE_DIR=str(triton))
    proc = subprocess.run([sys.executable, "-m", "research.perf.compile_cache", "--child", *args], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the timed child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--mask", default=None, help=f"head-mask JSON (default for smollm2-135m: {MASK}; else a "
                                                 "layer-wise 3:1 mask)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    mask = a.mask if a.mask is not None else (MASK if a.model == "smollm2-135m" else None)
    if a.child:
        print(json.dumps(one_step(a.model, mask, a.tokens, a.device)), flush=True)
        return {}
    from research.stage_caches import compile_cache_save, put_compile_cache

    args = ["--model", a.model, "--tokens", str(a.tokens), "--device", a.device] + (["--mask", mask] if mask else [])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cold = run_child(args, tmp / "inductor", tmp / "triton")
        print(f"empty caches: first step {cold['first_s']} s, second {cold['second_s']} s", flush=True)
        parts = compile_cache_save(tmp / "parts", tmp / "inductor", tmp / "triton")
        size = sum(p.stat().st_size for p in parts)
        for p in parts:
            put_compile_cache(p, tmp / "stage", tmp / "inductor2", tmp / "triton2")
        warm = run_child(args, tmp / "inductor2", tmp / "triton2")
        print(f"carried caches ({size / 1e6:.1f} MB gz in {len(parts)} part(s)): first step {warm['first_s']} s, "
              f"second {warm['second_s']} s; {cold['first_s'] / warm['first_s']:.1f}x faster first step", flush=True)
    out = {"model": a.model, "mask": mask, "tokens": a.tokens, "device": a.device, "empty": cold, "carried": warm,
           "archive_mb": round(size / 1e6, 2), "parts": len(parts),
           "first_step_ratio": round(cold["first_s"] / warm["first_s"], 2)}
    if a.out:
        from headscope.io import write_text

        write_text(a.out, json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
