"""Stage-3 ("long") recipes compared on the CPU from one post-stage-2 hybrid of the reference teacher.

The H200 run of reference.toml lost ~0.35 nats of held-out loss at the stage-1/2 length in stage 3 (4.25 after
distill, 4.60 at 2048 for the final model). This script trains stages 1-2 once at a short length (SHORT tokens),
then runs each stage-3 variant at 4x that length from the same stage-2 checkpoint (the stage-2 run folder copied,
then ``hybrid.train.run(resume=True, allow_config_change=True)`` with the variant as stage 3), every variant with
the same token budget, and measures before and after: held-out loss at SHORT and at 4x SHORT (the trainer's own
``heldout_loss`` windows), the teacher's on the same windows, and single-key NIAH at 4x SHORT.

    python research/train_hybrid/long_stage_cpu.py --mask /tmp/ref9/mask.json --out /tmp/long_stage
    # -> OUT/results.json (written after each variant), OUT/base (stages 1-2), OUT/v-<name> (each variant)

Variants (``VARIANTS``): "reference" (reference.toml's stage 3 as a recorded run used it: the run's mixture, CE,
lr = 0.4 x the distill lr, cosine over 2/3 of the steps then constant; reference.toml now has "low_lr"'s lr), "text" (the same with a text-heavy mixture), "low_lr" (lr / 4),
"distill_kl" (the registered "distill" stage at the long length: KL to the teacher + CE, the reference lr),
"distill_kl_low_lr" (the same at lr / 4). Caveat of the KL variants: here the long length (4x SHORT) is within
the teacher's training length (2048), as it is not on the GPU (8192, where the teacher's NIAH falls to 0.23).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

# the run's [data] of reference.toml (every stage's mixture unless a variant gives its own)
REFERENCE_MIXTURE = {"text": 0.3, "niah": 0.25, "multikey": 0.2, "reasoning": 0.2, "copy": 0.0, "teacher": 0.05}
TEXT_MIXTURE = {"text": 0.7, "niah": 0.1, "multikey": 0.1, "reasoning": 0.1, "copy": 0.0, "teacher": 0.0}
DISTILL_LR = 5e-4  # reference.toml's stage 2; its stage 3 had 2e-4 = 0.4x (the H200 run), now 5e-5 = 0.1x


def _long(name: str, lr_scale: float, data: dict | None = None, **extra: Any):
    def make(seq_len: int, batch: int, steps: int, distill_lr: float, base_data: dict) -> dict:
        s = {"name": name, "steps": steps, "lr": lr_scale * distill_lr, "seq_len": seq_len, "batch_size": batch,
             "warmup_steps": max(1, round(steps * 10 / 300)), "decay_steps": round(steps * 200 / 300),
             "weight_decay": 0.01, **extra}
        if data is not None:
            s["data"] = {**base_data, **data}
        return s

    return make


# name -> stage-3 table maker (seq_len, batch, steps, distill lr, the run's data table) -> a [[stages]] dict
VARIANTS = {
    "reference": _long("long", 0.4),
    "text": _long("long", 0.4, TEXT_MIXTURE),
    "low_lr": _long("long", 0.1),
    "distill_kl": _long("distill", 0.4, kl_weight=1.0, ce_weight=0.2, temperature=1.0),
    "distill_kl_low_lr": _long("distill", 0.1, kl_weight=1.0, ce_weight=0.2, temperature=1.0),
}


def base_config(a, out: Path) -> dict:
    """Stages 1-2 of reference.toml at a.short tokens (no stage 3: each variant adds its own)."""
    data = {"corpus": a.corpus, "haystack": a.haystack, "fast_niah": True, **REFERENCE_MIXTURE,
            "teacher_samples": a.teacher_samples, "teacher_sample_len": a.teacher_sample_len, "extra_queries": 2,
            "workers": 0}
    stages = [
        # train_gdn_qkv = false: stage 1 trains only the new parameters, as it did for the published numbers
        {"name": "align", "steps": a.align_steps, "lr": 2e-3, "seq_len": a.short, "batch_size": a.batch,
         "warmup_steps": max(1, a.align_steps // 30), "train_gdn_qkv": False},
        {"name": "distill", "steps": a.distill_steps, "lr": a.distill_lr, "seq_len": a.short, "batch_size": a.batch,
         "warmup_steps": max(1, a.distill_steps // 75), "weight_decay": 0.01, "kl_weight": 1.0, "ce_weight": 0.2,
         "temperature": 1.0},
    ]
    return {"out": str(out), "teacher": a.teacher, "mask": str(a.mask), "seed": a.seed, "device": "cpu",
            "log_every": a.log_every, "checkpoint_every": 0, "eval": "none", "threads": a.threads,
            "progress": False, "hybrid": {"gdn_fold_heads": True}, "data": data, "stages": stages}


def measure(model, tok, a, cache: dict) -> dict[str, float]:
    """Held-out loss at a.short and 4x a.short, NIAH accuracy at 4x a.short (hybrid.train.evals, float32)."""
    from hybrid.train.evals import EvalContext, heldout_loss, niah_accuracy

    model.eval()
    long = 4 * a.short
    ctx = {T: EvalContext(model, tok, T, n, torch.device("cpu"), nullcontext(), 0, cache)
           for T, n in ((a.short, a.eval_windows), (long, a.eval_windows))}
    out = {f"loss@{a.short}": heldout_loss(ctx[a.short]), f"loss@{long}": heldout_loss(ctx[long])}
    niah = EvalContext(model, tok, long, a.niah_n, torch.device("cpu"), nullcontext(), 0, cache)
    out[f"niah@{long}"] = niah_accuracy(niah)
    return {k: round(float(v), 4) for k, v in out.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mask", type=Path, required=True, help="head-mask JSON of the reference teacher (run.py's)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--teacher", default="default")
    ap.add_argument("--corpus", default="train", help="training text (hybrid.train.text.load_corpus)")
    ap.add_argument("--haystack", default="train", help="NIAH haystack of the training data")
    ap.add_argument("--short", type=int, default=256, help="stage-1/2 length; stage 3 trains at 4x")
    ap.add_argument("--batch", type=int, default=8, help="stage-1/2 rows; stage 3 has batch/4 (the same tokens)")
    ap.add_argument("--align-steps", type=int, default=150)
    ap.add_argument("--distill-steps", type=int, default=250)
    ap.add_argument("--distill-lr", type=float, default=DISTILL_LR)
    ap.add_argument("--long-steps", type=int, default=60)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    ap.add_argument("--teacher-samples", type=int, default=8)
    ap.add_argument("--teacher-sample-len", type=int, default=64,
                    help="tokens per teacher-sampled row (reference: 512; each is a decode step at every stage start)")
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--niah-n", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=25)
    a = ap.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    if a.batch % 4:
        raise SystemExit(f"--batch={a.batch}: give a multiple of 4 (stage 3 trains batch/4 rows at 4x the length)")

    torch.set_num_threads(a.threads)
    from headscope.io import write_text
    from headscope.reference import load_model
    from headscope.mask import HeadMask
    from hybrid.train import TrainConfig, run
    from hybrid.train.build import identity
    from hybrid.train.checkpoint import RunRecord, latest_checkpoint, load_checkpoint, write_run_record

    t_start = time.time()
    a.out.mkdir(parents=True, exist_ok=True)
    teacher, tok = load_model(a.teacher)
    mask = HeadMask.from_json(a.mask)
    cache: dict = {}
    result: dict[str, Any] = {"schema": "hybrid.train.long_stage_cpu", "settings": {**vars(a), "mask": str(a.mask),
                                                                                      "out": str(a.out)},
                              "teacher": measure(teacher, tok, a, cache), "variants": {}}
    print(f"[long_stage] teacher: {result['teacher']}", flush=True)

    base_dir = a.out / "base"
    base = TrainConfig.from_dict(base_config(a, base_dir))
    t0 = time.time()
    if (base_dir / "hybrid" / "config.json").exists():  # stages 1-2 done by an earlier call: reuse them
        from hybrid.train.build import build_hybrid

        student, _ = build_hybrid(teacher, str(a.mask), base.hybrid)
        tensors, _, _ = load_checkpoint(latest_checkpoint(base_dir))
        student.load_state_dict(tensors, strict=True)
    else:
        student = run(base, resume=latest_checkpoint(base_dir) is not None).model  # a killed call: continue
    result["stage2"] = {**measure(student, tok, a, cache), "minutes": round((time.time() - t0) / 60, 2)}
    print(f"[long_stage] after stages 1-2 ({result['stage2']['minutes']} min): {result['stage2']}", flush=True)
    del student
    write_text(a.out / "results.json", json.dumps(result, indent=1, default=str))

    stage3 = {"seq_len": 4 * a.short, "batch": a.batch // 4, "steps": a.long_steps, "distill_lr": a.distill_lr,
              "base_data": base.to_dict()["data"]}
    for name in names:
        t0 = time.time()
        d = a.out / f"v-{name}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        cfg_dict = base_config(a, d)
        stage = VARIANTS[name](**stage3)
        cfg_dict["stages"].append(stage)
        cfg = TrainConfig.from_dict(cfg_dict)
        # the stage-2 checkpoint, in a folder recorded as this 3-stage run: a run's identity names its stages, so
        # the 2-stage folder itself is refused even with allow_config_change (another run); its fingerprint (the
        # 2-stage config's) differs from this config's, hence allow_config_change=True
        shutil.copytree(base_dir / "checkpoints", d / "checkpoints")
        old = json.loads((base_dir / "run.json").read_text())
        write_run_record(d, RunRecord(identity(cfg, teacher, mask, tok), old["fingerprint"], old["config"]))
        res = run(cfg, resume=True, allow_config_change=True)
        train_min = (time.time() - t0) / 60
        last = [r for r in res.history if r.get("stage_index") == 2 and "loss" in r]
        row = {"stage3": {k: v for k, v in stage.items()}, **measure(res.model, tok, a, cache),
               "train_minutes": round(train_min, 2), "final_train_loss": last[-1]["loss"] if last else None,
               "minutes": round((time.time() - t0) / 60, 2)}
        result["variants"][name] = row
        write_text(a.out / "results.json", json.dumps(result, indent=1, default=str))
        print(f"[long_stage] {name}: { {k: v for k, v in row.items() if k != 'stage3'} }", flush=True)
        shutil.rmtree(d / "checkpoints", ignore_errors=True)  # the weights are in v-<name>/hybrid
    result["minutes_total"] = round((time.time() - t_start) / 60, 2)
    write_text(a.out / "results.json", json.dumps(result, indent=1, default=str))
    print(table(result, a.short), flush=True)
    return result


def table(result: dict, short: int) -> str:
    long = 4 * short
    keys = (f"loss@{short}", f"loss@{long}", f"niah@{long}")
    lines = [f"{'model':<20}" + "".join(f"{k:>14}" for k in keys) + f"{'ratio@' + str(short):>14}"]
    t = result["teacher"]
    rows = [("teacher", t), ("stage 2", result["stage2"])] + [(f"3: {n}", r) for n, r in result["variants"].items()]
    for n, r in rows:
        ratio = math.exp(r[keys[0]] - t[keys[0]])
        lines.append(f"{n:<20}" + "".join(f"{r[k]:>14.4f}" for k in keys) + f"{ratio:>14.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
