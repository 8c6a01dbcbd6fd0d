"""Reference teacher -> head-level hybrid at 1/8 of the teacher's attention KV cache, in one command:
mask (headscope, NIAH + reasoning), the three stages (hybrid.train), the saved hybrid reloaded from disk and
evaluated against the teacher, and the stage-2 throughput. Prints a table; writes OUT/results.json.

GPU (one H200, < 10 minutes in all; data/corpus carried, from experiments/prepare_corpus.py):
    python experiments/train_hybrid/run.py --config experiments/train_hybrid/reference.toml --out $OUT/hybrid
CPU (a few minutes; the same path with short lengths and few samples):
    python experiments/train_hybrid/run.py --config experiments/train_hybrid/tiny.toml --out /tmp/th --tiny

The mask keeps full attention on the KV groups (GQA: the query heads sharing a key/value head) with the
highest fused NIAH + reasoning score, 1/8 of all KV heads (headscope.select(..., fraction=1/8,
unit="kv_group")), so the hybrid's KV cache is 1/8 of the teacher's. --mask FILE uses a saved mask instead.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # NIAH needle depths; n // 5 prompts at each


def evaluate_both(models: dict, tok, L0: int, long_lengths: tuple[int, ...], n: int, n_reasoning: int,
                  ppl_windows: int):
    """Each model through the evaluation harness (``headscope.evaluate``, same prompts for all, greedy generation
    exact match as the headline): single-key NIAH at L0 and each long length, multi-key (4 keys) at L0, every
    reasoning family at its default size, held-out perplexity at L0. Returns (table, rows): one row per metric
    (``niah@L``, ``multikey@L0``, ``reasoning_<family>``, ``ppl@L0``), one column per model; and the raw rows."""
    import pandas as pd

    import headscope
    from hybrid.train.study_metrics import headline

    totals = (L0, *long_lengths)  # whole prompt lengths; each NIAH prompt leaves 8 tokens for the answer
    configs = {"niah": {"lengths": tuple(L - 8 for L in totals), "depths": DEPTHS, "n": max(1, n // len(DEPTHS)),
                        "haystack": "heldout"},
               "niah_multikey": {"lengths": (L0 - 8,), "n_keys": (4,), "n": n, "haystack": "heldout"},
               "reasoning": {"n": n_reasoning},
               "perplexity": {"lengths": (L0,), "n_windows": ppl_windows, "text": "heldout"}}
    table, frames = {}, []
    for name, model in models.items():
        df = headscope.evaluate(model, list(configs), tok, configs=configs, seed=12_345)
        df["model"] = name
        frames.append(df)
        h = headline(df.to_dict("records"), L0)
        niah = [h["niah"].get(str(L - 8)) for L in totals]
        col = {f"niah@{L}": v for L, v in zip(totals, niah)}
        col[f"multikey@{L0}"] = h["multikey"]
        col |= {f"reasoning_{f}": v for f, v in h["reasoning_by_family"].items()}
        col[f"ppl@{L0}"] = h["perplexity"].get(str(L0))
        table[name] = {k: float("nan") if v is None else float(v) for k, v in col.items()}
    return pd.DataFrame(table), pd.concat(frames, ignore_index=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="hybrid.train TOML (teacher, stages, data)")
    ap.add_argument("--out", type=Path, required=True, help="output folder (results.json, mask.json, run/)")
    ap.add_argument("--mask", default=None, help="a saved head-mask JSON instead of selecting one")
    ap.add_argument("--fraction", type=float, default=1 / 8, help="fraction of the teacher's KV heads kept")
    ap.add_argument("--tiny", action="store_true", help="CPU settings: short lengths, few samples")
    ap.add_argument("--device", default=None, help="override the config's device")
    ap.add_argument("--resume", action="store_true", help="continue the training in OUT/run")
    ap.add_argument("--n", type=int, default=None, help="NIAH / multi-key prompts per length (default 50; tiny 2)")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--eval-only", action="store_true",
                    help="no training: evaluate the hybrid a finished run left in OUT/run (OUT/run/hybrid, "
                         "OUT/run/log.jsonl, OUT/mask.json), e.g. one trained on the GPU and brought back")
    a = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    import hybrid
    from headscope.io import write_text
    from headscope.mask import HeadMask
    from headscope.reference import load_model
    from hybrid.train import TrainConfig, run
    from hybrid.train.throughput import measure_distill, measure_lm
    from hybrid.train.variants import make_mask

    a.out.mkdir(parents=True, exist_ok=True)
    overrides = {"out": str(a.out / "run")} | ({"device": a.device} if a.device else {})
    base = TrainConfig.from_file(a.config, mask=a.mask or str(a.out / "mask.json"), **overrides)
    device = torch.device("cuda" if base.device == "cuda" or (base.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    teacher, tok = load_model(base.teacher, device=device)
    train_len = teacher.config.max_position_embeddings  # the reference model trained at its full 2048
    L0 = 128 if a.tiny else min(2048, train_len)
    n = a.n or (2 if a.tiny else 50)

    t0 = time.time()
    if a.mask is None and not (a.out / "mask.json").exists():
        mask = make_mask(teacher, tok, a.fraction, n_samples=2 if a.tiny else 16,
                         context_length=120 if a.tiny else 1024, device=device, scores_path=a.out / "scores.json")
        write_text(a.out / "mask.json", mask.to_json())
    mask = HeadMask.from_json(base.mask)
    mask_seconds = time.time() - t0
    print(f"[run.py] mask ready in {mask_seconds:.1f} s", flush=True)  # phase times: where a GPU call's time goes

    if a.eval_only:
        from hybrid.train.trainer import RunResult, read_history

        run_dir = Path(base.out)
        if not (run_dir / "hybrid" / "config.json").exists() or not (run_dir / "log.jsonl").exists():
            raise SystemExit(f"--eval-only: no finished run in {run_dir} (hybrid/config.json and log.jsonl); "
                             "train first (run.py without --eval-only), or unpack a run brought back from the GPU")
        result = RunResult(run_dir, run_dir / "hybrid", read_history(run_dir))
        # the training's own clock: the stages' minutes from its log (set-up and warm-up steps not counted)
        train_minutes = sum({r["stage"]: r["minutes"] for r in result.history if "minutes" in r}.values())
    else:
        t0 = time.time()
        result = run(base, resume=a.resume)
        train_minutes = (time.time() - t0) / 60
        print(f"[run.py] training done in {train_minutes:.2f} min", flush=True)
    t_eval = time.time()

    hybrid.register()
    hyb = AutoModelForCausalLM.from_pretrained(result.model_path, dtype=torch.float32).to(device).eval()
    assert HeadMask.from_dict(hyb.config.head_mask) == mask, "the saved hybrid must carry its mask"
    kv = hybrid.cache_nbytes(hyb, L0)
    teacher_kv = hybrid.teacher_cache_nbytes(teacher, L0)
    long_lengths = tuple(f * (L0 if a.tiny else train_len) for f in (2, 4, 8))
    table, rows = evaluate_both({"teacher": teacher, "hybrid": hyb}, tok, L0, long_lengths, n,
                                n_reasoning=4 if a.tiny else 100, ppl_windows=4 if a.tiny else 32)
    rows.to_csv(a.out / "eval_rows.csv", index=False)  # every harness row of both models
    table["hybrid / teacher"] = table["hybrid"] / table["teacher"].where(table["teacher"] != 0)
    print(f"[run.py] evaluation done in {time.time() - t_eval:.1f} s", flush=True)
    targets = {f"niah@{L0}": 0.9, f"multikey@{L0}": 0.8, **{i: 0.9 for i in table.index if i.startswith("reasoning_")}}
    checks = {k: bool(table.loc[k, "hybrid"] >= v * table.loc[k, "teacher"]) for k, v in targets.items()}
    checks[f"ppl@{L0} <= 1.2x"] = bool(table.loc[f"ppl@{L0}", "hybrid"] <= 1.2 * table.loc[f"ppl@{L0}", "teacher"])

    stage_minutes = {}
    for r in result.history:
        if "minutes" in r:
            stage_minutes[r["stage"]] = r["minutes"]
    throughput = None
    if not a.no_throughput:
        B, T = (2, 64) if a.tiny else (16, L0)
        throughput = {"distill": measure_distill(hyb, teacher, B, T, steps=3 if a.tiny else 10),
                      "teacher_train": measure_lm(teacher, B, T, steps=3 if a.tiny else 10)}

    out = {"schema": "hybrid.train.experiment", "teacher": base.teacher, "device": str(device),
           "mask": {"fa_heads": [h.to_list() for h in mask.fa_heads], "ratio_la_fa": mask.ratio,
                    "kv_cache_fraction": kv["fa_kv"] / teacher_kv, "seconds": round(mask_seconds, 1)},
           "train": {"minutes_total": round(train_minutes, 2), "minutes_by_stage": stage_minutes,
                     "minutes_from": "stage minutes in the log" if a.eval_only else "wall clock of the training",
                     "config": base.to_dict()},
           "eval": {"length": L0, "long_lengths": list(long_lengths), "n": n,
                    "table": json.loads(table.to_json(orient="index")), "checks": checks},
           "throughput": throughput}
    write_text(a.out / "results.json", json.dumps(out, indent=1, default=str))
    print(table.to_string(float_format=lambda x: f"{x:.3f}"))
    print(f"KV cache: hybrid {kv['fa_kv'] / teacher_kv:.3f} of the teacher's at {L0} tokens "
          f"(+ GDN state {kv['gdn_state']} B); mask {mask.ratio} LA:FA")
    print(f"training: {train_minutes:.2f} min ({stage_minutes}); checks: {checks}")
    if throughput:
        d, t = throughput["distill"], throughput["teacher_train"]
        print(f"stage 2: {d['tokens_per_s']:,.0f} tokens/s, {d['tflops']:.2f} TFLOP/s, MFU {d['mfu']:.2%} of "
              f"{d['peak_flops'] / 1e12:.0f} TFLOP/s, GPU utilisation {d['gpu_utilisation_percent']}%; teacher "
              f"training step: {t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.2%}")
    return out


if __name__ == "__main__":
    main()
