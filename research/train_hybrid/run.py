"""Reference teacher -> head-level hybrid at 1/8 of the teacher's attention KV cache, in one command:
mask (headscope, NIAH + reasoning), the three stages (hybrid.train), the saved hybrid reloaded from disk and
evaluated against the teacher, and the stage-2 throughput. Prints a table; writes OUT/results.json.

GPU (one H200, < 10 minutes in all; data/corpus carried, from research/prepare_corpus.py):
    python research/train_hybrid/run.py --config research/train_hybrid/reference.toml --out $OUT/hybrid
CPU (a few minutes; the same path with short lengths and few samples):
    python research/train_hybrid/run.py --config research/train_hybrid/tiny.toml --out /tmp/th --tiny

SmolLM2-135M-Instruct (the real teacher; its GGUF staged on a remote GPU with python -m research.stage, docs/research.md):
    python research/train_hybrid/run.py --config research/train_hybrid/smollm2.toml --out $OUT/smol \
        [--stop-after 420] [--resume]       # two calls of <= 520 s: stop at a checkpoint, then continue
    python research/train_hybrid/run.py --config research/train_hybrid/smollm2.toml --out $OUT/smol \
        --throughput-only                   # untrained hybrid: stage-2 + teacher training-step MFU, batch sweep

Past the teacher's context (research/train_hybrid/smollm2_long.toml): --suite fidelity_long,fidelity evaluates the
held-out suites, --generate-speed 32640,8064 times the trained hybrid's generate() at 32K positions beside the
teacher's at its 8192 (batch 1, 128 new tokens; OUT/generate_speed.json) before them.

Evaluation lengths (hybrid.train.evals.eval_lengths): L0 = the align / distill length, never past the teacher's
own training length; NIAH at L0 and 2x / 4x / 8x L0 (at most 16384 tokens: --max-eval-length).

The mask keeps full attention on the KV groups (GQA: the query heads sharing a key/value head) with the
highest fused NIAH + reasoning score (receiver scores combined with the sender scores of iterated path
patching, --sender-rounds), 1/8 of all KV heads (headscope.select(..., fraction=1/8,
unit="kv_group")), so the hybrid's KV cache is 1/8 of the teacher's. --mask FILE uses a saved mask instead.
Reasoning enters the fusion only where the teacher solves >= 90% of its clean prompts (research.studies.
variants.selection_scores); SmolLM2-135M does not, so its mask comes from NIAH alone (results.json: mask.reasoning_left_out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from hybrid.train.trainer import CheckpointAndStop

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # NIAH needle depths; n // 5 prompts at each


def evaluate_both(models: dict, tok, L0: int, long_lengths: tuple[int, ...], n: int, n_reasoning: int,
                  ppl_windows: int, forms: dict[str, dict] | None = None):
    """Each model through the evaluation harness (``headscope.evaluate``, same prompts for all, greedy generation
    exact match as the headline): single-key NIAH at L0 and each long length, multi-key (4 keys) at L0, every
    reasoning family at its default size in the prompt ``forms`` given (the teacher's: a registry model's
    few-shot forms, headscope.zoo.task_defaults), held-out perplexity at L0. Returns (table, rows): one row per metric
    (``niah@L``, ``multikey@L0``, ``reasoning_<family>``, ``ppl@L0``), one column per model; and the raw rows."""
    import pandas as pd

    import headscope
    from research.studies.metrics import headline

    totals = (L0, *long_lengths)  # whole prompt lengths; each NIAH prompt leaves 8 tokens for the answer
    configs = {"niah": {"lengths": tuple(L - 8 for L in totals), "depths": DEPTHS, "n": max(1, n // len(DEPTHS)),
                        "haystack": "heldout"},
               "niah_multikey": {"lengths": (L0 - 8,), "n_keys": (4,), "n": n, "haystack": "heldout"},
               "reasoning": {"n": n_reasoning, "forms": forms or {}},
               "perplexity": {"lengths": (L0,), "n_windows": ppl_windows, "text": "heldout"}}
    frames = []
    for name, model in models.items():
        df = headscope.evaluate(model, list(configs), tok, configs=configs, seed=12_345)
        df["model"] = name
        frames.append(df)
    rows = pd.concat(frames, ignore_index=True)
    return headline_table(rows, L0, long_lengths), rows


def headline_table(rows, L0: int, long_lengths: tuple[int, ...]):
    """``evaluate_both``'s table from its rows (one column per model)."""
    import pandas as pd

    from research.studies.metrics import headline

    totals = (L0, *long_lengths)
    table = {}
    for name, df in rows.groupby("model", sort=False):
        h = headline(df.to_dict("records"), L0)
        niah = [h["niah"].get(str(L - 8)) for L in totals]
        col = {f"niah@{L}": v for L, v in zip(totals, niah)}
        col[f"multikey@{L0}"] = h["multikey"]
        col |= {f"reasoning_{f}": v for f, v in h["reasoning_by_family"].items()}
        col[f"ppl@{L0}"] = h["perplexity"].get(str(L0))
        table[name] = {k: float("nan") if v is None else float(v) for k, v in col.items()}
    return pd.DataFrame(table)


def split_by_length(name: str, over: dict) -> list[tuple[str, dict]]:
    """Evaluation ``name`` with overrides ``over`` as the parts ``run_suite`` saves one by one: one per prompt
    length where its config has several ``lengths`` (``("fidelity_niah_2040", {..., "lengths": (2040,)})``, ...:
    the same rows, since each length's prompts are seeded by the length alone), else the whole evaluation."""
    from headscope.evaluate.registry import make_config

    lengths = getattr(make_config(name, over), "lengths", ())
    if len(lengths) < 2:
        return [(name, dict(over))]
    return [(f"{name}_{L}", {**over, "lengths": (L,)}) for L in sorted(set(lengths))]


class SuiteStopped(Exception):
    """``run_suite``'s ``stop()`` said to stop: the part under way was finished and saved first."""


def same_weights(key_file: Path, model_key: str | None) -> bool:
    """Whether ``key_file`` names the weights ``model_key`` (their hash): a result saved beside it is this model's."""
    return model_key is not None and key_file.is_file() and key_file.read_text().strip() == model_key


def run_suite(model, tok, teacher, suite: str, out: Path, model_key: str | None = None, stop=None):
    """``headscope.evaluate(model, suite, teacher=teacher)`` one evaluation at a time, each saved to
    OUT/<suite>_parts/<evaluation>/ as soon as it is done (one with several prompt lengths: each length on its own,
    OUT/<suite>_parts/<evaluation>_<length>/, so a call cut short keeps the lengths done); a part already saved
    there (a call cut short) is read back, not run again. All rows then go to OUT/<suite>/ (with the parts' side
    files, e.g. the chat answers). ``model_key`` (the weights' hash) ties the parts to the model: parts of another
    model are dropped. With ``HEADSCOPE_TEACHER_CACHE`` set (``overlap.sh`` sets it to RUNS/teacher_cache), the
    teacher's side of the suite is kept there and read back for the next student (``headscope.evaluate``'s
    ``teacher_cache``). ``stop``: called after each part is saved; when it returns True the suite stops there
    (``SuiteStopped``), e.g. a study worker asked to stop lets the part in hand finish instead of losing it.
    Returns the rows."""
    import shutil

    import pandas as pd

    from headscope.evaluate import evaluate, save_results
    from headscope.evaluate.api import resolve_suite
    from headscope.evaluate.output import read_results
    from headscope.io import write_text

    parts_dir = out / f"{suite}_parts"
    key_file = parts_dir / "model_key.txt"
    if parts_dir.is_dir() and not same_weights(key_file, model_key):
        shutil.rmtree(parts_dir)  # another model's (or unknown) parts
    if model_key is not None:
        parts_dir.mkdir(parents=True, exist_ok=True)
        write_text(key_file, model_key + "\n")
    frames = []
    for name, over in resolve_suite(suite)[1]:
        pieces = split_by_length(name, over)
        if (parts_dir / name / "results.json").is_file():  # saved whole (also by earlier versions of this function)
            pieces = [(name, dict(over))]
        for label, cfg in pieces:
            part = parts_dir / label
            if (part / "results.json").is_file():
                print(f"[run.py] suite {suite}: {label} already done ({part}); read back", flush=True)
                frames.append(read_results(part))
                continue
            t0 = time.time()
            df = evaluate(model, [name], tok, configs={name: cfg}, teacher=teacher, progress=True,
                          teacher_cache=os.environ.get("HEADSCOPE_TEACHER_CACHE") or None)
            t_eval = time.time()
            df["suite"] = suite
            save_results(df, part, overwrite=True, figures=False, fsync=False)  # the whole suite is saved again
            frames.append(df)
            ok = df[df["status"] == "ok"]
            keys = [c for c in ("metric", "family", "phrasing", "context_length") if ok[c].notna().any()]
            inside = sum((df.attrs.get("meta") or {}).get("seconds", {}).values())
            print(f"[run.py] suite {suite}: {label} done in {time.time() - t0:.0f} s (the evaluation itself "
                  f"{inside:.1f} s, evaluate() {t_eval - t0:.1f} s, saving {time.time() - t_eval:.1f} s; "
                  f"{time.strftime('%H:%M:%S')})\n"
                  + ok.groupby(keys, dropna=False)["value"].mean().to_string(), flush=True)
            if stop is not None and stop():
                raise SuiteStopped(f"suite {suite}: stopped after {label} (saved)")
    rows = pd.concat(frames, ignore_index=True)
    save_results(rows, out / suite, overwrite=True)
    for f in parts_dir.glob("*/*.jsonl"):
        shutil.copy2(f, out / suite / f.name)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="hybrid.train TOML (teacher, stages, data)")
    ap.add_argument("--out", type=Path, required=True, help="output folder (results.json, mask.json, run/)")
    ap.add_argument("--mask", default=None, help="a saved head-mask JSON instead of selecting one")
    ap.add_argument("--fraction", type=float, default=1 / 8, help="fraction of the teacher's KV heads kept")
    ap.add_argument("--sender-rounds", type=int, default=None,
                    help="rounds of iterated path patching in the mask's scores (default 3; --tiny: 1; 0: receiver "
                         "scores alone)")
    ap.add_argument("--tiny", action="store_true", help="CPU settings: short lengths, few samples")
    ap.add_argument("--device", default=None, help="override the config's device")
    ap.add_argument("--resume", action="store_true", help="continue the training in OUT/run")
    ap.add_argument("--n", type=int, default=None, help="NIAH / multi-key prompts per length (default 50; tiny 2)")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--throughput-only", action="store_true",
                    help="no training: the untrained hybrid from the mask, stage-2 and teacher training-step "
                         "throughput over --batches at the stage-1/2 length; writes OUT/throughput.json")
    ap.add_argument("--batches", default=None,
                    help="batch sizes of --throughput-only, comma-separated (default 8,16,32,48,64; tiny 1,2)")
    ap.add_argument("--compare-naive", action="store_true",
                    help="--throughput-only: also time each batch with fused_loss='off' (full logits) beside the "
                         "distill stage's own fused_loss setting")
    ap.add_argument("--compile", action="store_true",
                    help="--throughput-only: also time each batch's stage-2 step with the student's decoder layers "
                         "torch.compile'd (hybrid.train.build.compile_decoder_layers; TrainConfig.compile trains so), "
                         "and with the teacher's layers compiled too (on CUDA the frozen teacher also held in bf16)")
    from hybrid.train.build import COMPILE_MODES

    ap.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                    help="--compile: torch.compile's mode for the compiled side runs (reduce-overhead, CUDA graphs: "
                         "refused on CUDA, where it failed: research.perf.sweep.CUDA_GRAPH_MODES)")
    ap.add_argument("--compiled-only", action="store_true",
                    help="--throughput-only --compile without the eager stage-2 step and teacher step: for batch "
                         "sizes whose eager step does not fit in memory (the compiled layers keep fewer "
                         "activations: SmolLM2 at batch 32, 54 GiB against 83 GiB eager)")
    ap.add_argument("--bf16-weights", action="store_true",
                    help="--throughput-only --compile: also time the compiled student with bf16 working weights "
                         "and float32 masters (hybrid.train.precision; TrainConfig.working_dtype = 'bfloat16' "
                         "trains so) beside the compiled bf16 teacher")
    ap.add_argument("--profile", action="store_true",
                    help="--throughput-only: also profile each batch's stage-2 step and teacher step "
                         "(research.perf.throughput.profile_step: kernel time by category, top kernels)")
    ap.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                    help="stop the training at the first checkpoint written after SECONDS from the start (exit 3; "
                         "continue with --resume): a GPU call that ends cleanly instead of being killed")
    ap.add_argument("--max-eval-length", type=int, default=None,
                    help="longest NIAH length of the evaluation (default 16384)")
    ap.add_argument("--seed", type=int, default=None, help="override the config's seed (the mask is the seed's own "
                    "unless --mask gives one)")
    ap.add_argument("--suite", default=None, help="also run these headscope.evaluate suites (comma-separated, e.g. "
                    "fidelity,fidelity_long) on the trained hybrid against the teacher: OUT/<suite>/ and results.json's "
                    "\"suites\"")
    ap.add_argument("--scores", type=Path, default=None, help="the teacher's fused scores for the mask: read when the "
                    "file holds this teacher's scores with these settings, else computed and written there (default "
                    "OUT/scores.json); the jobs of one recipe share one file")
    ap.add_argument("--mask-only", action="store_true", help="write OUT/mask.json (and OUT/scores.json) and stop")
    ap.add_argument("--no-parity", action="store_true", help="(read by python -m research.launch) leave out the "
                    "backend-parity step after training")
    ap.add_argument("--eval-only", action="store_true",
                    help="no training: evaluate the hybrid a finished run left in OUT/run (OUT/run/hybrid, "
                         "OUT/run/log.jsonl, OUT/mask.json), e.g. one trained on the GPU and brought back")
    ap.add_argument("--generate-speed", default=None, metavar="PROMPT[,TEACHER_PROMPT]",
                    help="after the training, before the suites: generate() speed and cache bytes of the trained "
                         "hybrid at PROMPT tokens beside the teacher at TEACHER_PROMPT (default PROMPT), batch 1, "
                         "128 new tokens (research.perf.generate_speed): OUT/generate_speed.json, results.json's "
                         "\"generate_speed\"; read back when a resumed call finds it for the same weights")
    a = ap.parse_args(argv)
    if a.generate_speed is not None:
        try:
            a.generate_speed = generate_speed_lengths(a.generate_speed)
        except ValueError as err:
            ap.error(str(err))
    if a.compiled_only and not (a.compile and a.throughput_only):
        ap.error("--compiled-only times only the compiled side runs: give it with --throughput-only --compile")
    if a.bf16_weights and not (a.compile and a.throughput_only):
        ap.error("--bf16-weights is a compiled side run: give it with --throughput-only --compile")

    from transformers import AutoModelForCausalLM

    import hybrid
    from headscope.io import write_text
    from headscope.mask import HeadMask
    from headscope.reference import load_model
    from hybrid.train import TrainConfig, run
    from hybrid.train.evals import MAX_EVAL_LENGTH, eval_lengths
    from research.perf.throughput import measure_distill, measure_lm
    from hybrid.train.trainer import RunResult, read_history
    from research.studies.variants import make_mask

    a.out.mkdir(parents=True, exist_ok=True)
    overrides = {"out": str(a.out / "run")} | ({"device": a.device} if a.device else {}) | \
        ({"seed": a.seed} if a.seed is not None else {})
    base = TrainConfig.from_file(a.config, mask=a.mask or str(a.out / "mask.json"), **overrides)
    device = torch.device("cuda" if base.device == "cuda" or (base.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if a.throughput_only and a.compile:
        from research.perf.sweep import check_compile_mode

        try:  # before minutes of loading and scoring
            check_compile_mode(a.compile_mode, device)
        except ValueError as err:
            ap.error(str(err))
    t_start = time.time()
    teacher, tok = load_model(base.teacher, device=device)
    # L0: the align / distill length (2048; tiny.toml 128), never past the teacher's training length; NIAH at
    # 2x/4x/8x L0 (SmolLM2's config says 8192 positions, but it is solid only to 2K: see eval_lengths)
    L0, long_lengths = eval_lengths(teacher, base, cap=a.max_eval_length or MAX_EVAL_LENGTH)
    n = a.n or (2 if a.tiny else 50)

    t0 = time.time()
    if a.mask is None and not (a.out / "mask.json").exists():
        rounds = a.sender_rounds if a.sender_rounds is not None else (1 if a.tiny else 3)
        mask = make_mask(teacher, tok, a.fraction, n_samples=2 if a.tiny else 16,
                         context_length=120 if a.tiny else 1024, device=device,
                         scores_path=a.scores or a.out / "scores.json",
                         sender_rounds=rounds)
        write_text(a.out / "mask.json", mask.to_json())
    mask = HeadMask.from_json(base.mask)
    mask_seconds = time.time() - t0
    print(f"[run.py] mask ready in {mask_seconds:.1f} s: {len(mask.fa_heads)} FA query heads of "
          f"{mask.n_layers * mask.n_heads}, {mask.ratio} LA:FA", flush=True)  # phase times: where a call's time goes
    left_out = reasoning_left_out(a.scores or a.out / "scores.json")
    if left_out:
        print(f"[run.py] the mask's scores are NIAH alone: {left_out}", flush=True)
    if a.mask_only:
        return {"mask": str(a.out / "mask.json"), "seconds": round(mask_seconds, 1)}

    if a.throughput_only:
        return throughput_only(a, base, teacher, device, L0, mask)

    if a.eval_only:
        run_dir = Path(base.out)
        if not (run_dir / "hybrid" / "config.json").exists() or not (run_dir / "log.jsonl").exists():
            raise SystemExit(f"--eval-only: no finished run in {run_dir} (hybrid/config.json and log.jsonl); "
                             "train first (run.py without --eval-only), or unpack a run brought back from the GPU")
        result = RunResult(run_dir, run_dir / "hybrid", read_history(run_dir))
    else:
        t0 = time.time()
        on_step = None if a.stop_after is None else stop_at_checkpoint(base, a.stop_after, t_start)
        try:
            result = run(base, resume=a.resume, on_step=on_step)
        except StopAtCheckpoint as stop:
            print(f"[run.py] stopped at checkpoint {stop} after {time.time() - t_start:.0f} s (--stop-after "
                  f"{a.stop_after:g}): continue with --resume", flush=True)
            sys.exit(3)
        train_minutes = (time.time() - t0) / 60
        print(f"[run.py] training done in {train_minutes:.2f} min", flush=True)
        if int(os.environ.get("RANK", "0")) != 0:  # under torchrun the ranks trained together; rank 0 evaluates
            return {}
    # each stage's last minutes, from the whole log (--eval-only's history is that log already): a resumed call's
    # own history holds only the steps it trained
    history = result.history if a.eval_only else read_history(base.out)
    names = [s.name for s in base.stages]  # a stage name used twice (a "distill" stage 3) is keyed "distill (3)"
    stage_minutes = {(r["stage"] if names.count(r["stage"]) == 1 else f"{r['stage']} ({r['stage_index'] + 1})"):
                     r["minutes"] for r in history if "minutes" in r}
    if a.eval_only or a.resume:  # the training's own clock: the stages' minutes (set-up and warm-up steps not counted)
        train_minutes = sum(stage_minutes.values())
    t_eval = time.time()

    hybrid.register()
    hyb = AutoModelForCausalLM.from_pretrained(result.model_path, dtype=torch.float32).to(device).eval()
    assert HeadMask.from_dict(hyb.config.head_mask) == mask, "the saved hybrid must carry its mask"
    kv = hybrid.cache_nbytes(hyb, L0)
    teacher_kv = hybrid.teacher_cache_nbytes(teacher, L0)
    from headscope.tasks.reasoning import FAMILIES
    from headscope.zoo import task_defaults

    forms = {f: task_defaults(base.teacher, f) for f in FAMILIES}  # the teacher's prompt forms, for both models
    from headscope.io import file_sha256

    weights = Path(result.model_path) / "model.safetensors"
    model_key = file_sha256(weights) if weights.is_file() else None
    speed = None
    if a.generate_speed:
        speed = generate_speed(a.generate_speed, base.teacher, result.model_path, device, a.out, model_key, a.tiny)
    # the suites first (the fidelity suite is what a broad-data run is judged by; the template evaluation below
    # uses the training mixture's own templates): a call cut short by its time limit has them saved
    suites = {}
    for name in [x for x in (a.suite or "").split(",") if x]:
        t_suite = time.time()
        rows_s = run_suite(hyb, tok, teacher, name, a.out, model_key)
        done = rows_s[rows_s["status"] == "ok"]
        keys = [c for c in ("evaluation", "metric", "family", "phrasing", "context_length") if c in done]
        suites[name] = {"seconds": round(time.time() - t_suite, 1), "folder": name,
                        "values": {" / ".join(str(r[c]) for c in keys if r[c] == r[c] and r[c] is not None): r["value"]
                                   for _, r in done.iterrows()}}
        print(f"[run.py] suite {name} done in {suites[name]['seconds']:.0f} s", flush=True)

    t_eval = time.time()
    key_file = a.out / "eval_rows.model_key.txt"
    if (a.out / "eval_rows.csv").is_file() and same_weights(key_file, model_key):  # a call cut short after it
        import pandas as pd

        rows = pd.read_csv(a.out / "eval_rows.csv")
        table = headline_table(rows, L0, long_lengths)
        print(f"[run.py] evaluation of this hybrid already in {a.out / 'eval_rows.csv'}; read back", flush=True)
    else:
        table, rows = evaluate_both({"teacher": teacher, "hybrid": hyb}, tok, L0, long_lengths, n,
                                    n_reasoning=4 if a.tiny else 100, ppl_windows=4 if a.tiny else 32, forms=forms)
        write_text(a.out / "eval_rows.csv", rows.to_csv(index=False))  # every harness row of both models
        if model_key:
            write_text(key_file, model_key + "\n")
    table["hybrid / teacher"] = table["hybrid"] / table["teacher"].where(table["teacher"] != 0)
    print(f"[run.py] evaluation done in {time.time() - t_eval:.1f} s", flush=True)
    targets = {f"niah@{L0}": 0.9, f"multikey@{L0}": 0.8, **{i: 0.9 for i in table.index if i.startswith("reasoning_")}}
    checks = {k: bool(table.loc[k, "hybrid"] >= v * table.loc[k, "teacher"]) for k, v in targets.items()}
    checks[f"ppl@{L0} <= 1.2x"] = bool(table.loc[f"ppl@{L0}", "hybrid"] <= 1.2 * table.loc[f"ppl@{L0}", "teacher"])

    throughput = None
    if not a.no_throughput:
        B, T = (2, 64) if a.tiny else (16, L0)
        throughput = {"distill": measure_distill(hyb, teacher, B, T, steps=3 if a.tiny else 10),
                      "teacher_train": measure_lm(teacher, B, T, steps=3 if a.tiny else 10)}

    out = {"schema": "hybrid.train.experiment", "teacher": base.teacher, "device": str(device),
           "mask": {"fa_heads": [h.to_list() for h in mask.fa_heads], "ratio_la_fa": mask.ratio,
                    "kv_cache_fraction": kv["fa_kv"] / teacher_kv, "seconds": round(mask_seconds, 1),
                    "reasoning_left_out": left_out},
           "train": {"minutes_total": round(train_minutes, 2), "minutes_by_stage": stage_minutes,
                     "minutes_from": ("stage minutes in the log" if a.eval_only or a.resume
                                      else "wall clock of the training"),
                     "config": base.to_dict()},
           "eval": {"length": L0, "long_lengths": list(long_lengths), "n": n,
                    "table": json.loads(table.to_json(orient="index")), "checks": checks},
           "suites": suites, "throughput": throughput, "generate_speed": speed}
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


def generate_speed_lengths(spec: str) -> tuple[int, int]:
    """"PROMPT[,TEACHER_PROMPT]" -> (prompt, teacher prompt), each a whole number of tokens >= 8."""
    parts = [p.strip() for p in str(spec).split(",")]
    try:
        lengths = [int(p) for p in parts]
    except ValueError:
        lengths = []
    if len(parts) not in (1, 2) or len(lengths) != len(parts) or min(lengths) < 8:
        raise ValueError(f"--generate-speed {spec!r}: give PROMPT or PROMPT,TEACHER_PROMPT in tokens (each >= 8), "
                         "e.g. 32640,8064: the hybrid at 32K with 128 new tokens, the teacher at its 8192")
    return lengths[0], lengths[-1]


def generate_speed(lengths: tuple[int, int], teacher: str, model_path, device, out: Path, model_key: str | None,
                   tiny: bool = False) -> dict:
    """research.perf.generate_speed on the trained hybrid (``model_path``) at ``lengths[0]`` prompt tokens beside
    the teacher on the same engine at ``lengths[1]``: batch 1, 128 new tokens (tiny: 2), the CUDA-graph fast path
    in bf16 on CUDA (the torch.compile'd step and transformers' own loops left out: each would compile for a minute
    or more). Writes OUT/generate_speed.json (with the weights' key beside it) and returns {"file", "rows"}; a call
    that finds the file for the same weights reads it back. A failure is printed and returned ({"error", "argv"}),
    not raised: the suites after it still run."""
    from headscope.io import write_text
    from research.perf import generate_speed as gs

    path, key_file = out / "generate_speed.json", out / "generate_speed.model_key.txt"
    if not (path.is_file() and same_weights(key_file, model_key)):
        argv = ["--model", str(teacher), "--hybrid", str(model_path), "--prompt", str(lengths[0]),
                "--teacher-prompt", str(lengths[1]), "--new", "2" if tiny else "128", "--batch", "1",
                "--repeats", "1" if tiny else "3", "--device", device.type,
                "--skip", "eager,teacher_dynamic,teacher_static", "--out", str(path)]
        if device.type == "cuda":
            argv += ["--dtype", "bfloat16"]
        t0 = time.time()
        try:  # a measurement beside the run: its failure (e.g. out of memory) must not cost the suites after it
            rc = gs.main(argv)
        except Exception as err:  # noqa: BLE001 - reported and recorded, the run goes on
            rc = f"{type(err).__name__}: {err}"
        if rc != 0:
            print(f"[run.py] generate speed failed ({rc}); the suites go on", flush=True)
            return {"error": str(rc), "argv": argv}
        if model_key:
            write_text(key_file, model_key + "\n")
        print(f"[run.py] generate speed done in {time.time() - t0:.0f} s: {path}", flush=True)
    else:
        print(f"[run.py] generate speed of this hybrid already in {path}; read back", flush=True)
    return {"file": path.name, "rows": json.loads(path.read_text())["rows"]}


class StopAtCheckpoint(CheckpointAndStop):
    """--stop-after: the time is up; the trainer checkpoints the step just trained and stops (the message names
    the checkpoint)."""


def stop_at_checkpoint(config, seconds: float, t_start: float):
    """An ``on_step`` callback for ``hybrid.train.run``: once ``seconds`` have passed since ``t_start``, stop right
    after the current step, which the trainer then checkpoints (``hybrid.train.trainer.CheckpointAndStop``), so a
    resumed call trains no step twice and loses none. Not at a stage's last step: a finished stage goes on into the
    next (and the last one into the final save and the evaluation). One process only: under torchrun the ranks'
    clocks could disagree."""
    names = [s.name for s in config.stages]
    steps = {s.name: s.steps for s in config.stages}

    def on_step(stage: str, step: int) -> None:
        if time.time() - t_start < seconds or step >= steps[stage]:
            return
        raise StopAtCheckpoint(f"s{names.index(stage) + 1}-{stage}-{step:06d}")

    return on_step


def reasoning_left_out(scores_path: Path) -> str | None:
    """Why the mask's scores hold no reasoning (research.studies.variants.selection_scores), or None."""
    if not scores_path.exists():
        return None
    return json.loads(scores_path.read_text()).get("settings", {}).get("reasoning_left_out")


def throughput_only(a, base, teacher, device, T: int, mask) -> dict:
    """Stage-2 throughput of the untrained hybrid (the mask, the config's hybrid options) against the teacher's
    own training step at each batch size of --batches (research.perf.sweep: side runs, out-of-memory handling, every
    measurement written to OUT/throughput.json as it is taken); the best by stage-2 tokens/s (= by MFU: one length,
    the same FLOPs per token) is the result. Model FLOPs: research.perf.throughput (student fwd + bwd + teacher fwd,
    attention cores included; MFU against 790 TFLOP/s)."""
    from headscope.io import write_text
    from hybrid.train.build import build_hybrid
    from research.perf.sweep import SCHEMA, SweepConfig, run_sweep

    if a.tiny:
        T = 64
    batches = tuple(int(b) for b in (a.batches or ("1,2" if a.tiny else "8,16,32,48,64")).split(","))
    steps, warmup = (2, 1) if a.tiny else (10, 3)
    fused = next((s.fused_loss for s in base.stages if s.name == "distill"), "auto")  # the training's setting
    cfg = SweepConfig(batches=batches, seq_len=T, steps=steps, warmup=warmup, fused_loss=fused,
                      compare_naive=a.compare_naive, compile=a.compile, compile_mode=a.compile_mode,
                      compiled_only=a.compiled_only, bf16_weights=a.bf16_weights, profile=a.profile)
    student, _ = build_hybrid(teacher, base.mask, base.hybrid)
    path = a.out / "throughput.json"
    try:
        swept = run_sweep(student.to(device), teacher, cfg, out_path=path)
    except RuntimeError as err:
        raise SystemExit(f"--throughput-only: {err}") from None
    out = {"schema": SCHEMA, "teacher": base.teacher, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "hybrid": base.hybrid, "mask": {"fa_heads": len(mask.fa_heads), "ratio_la_fa": mask.ratio}, **swept}
    write_text(path, json.dumps(out, indent=1, default=str))
    best = out["best"]
    if "distill" in best:
        d, tb = best["distill"], best["teacher_train_best"]
        print(f"stage 2 (best: batch {best['batch_size']} x {T}): {d['tokens_per_s']:,.0f} tokens/s, "
              f"{d['tflops']:.1f} TFLOP/s = MFU {d['mfu']:.2%} of {d['peak_flops'] / 1e12:.0f} TFLOP/s (model "
              f"FLOPs/token: student fwd {d['student_fwd_flops_per_token'] / 1e6:.0f}M x 3 + teacher fwd "
              f"{d['teacher_fwd_flops_per_token'] / 1e6:.0f}M); teacher training step at that batch: MFU "
              f"{best['teacher_train_same_batch']['mfu']:.2%}, best {tb['mfu']:.2%} (batch {tb['batch_size']})")
    for kind, what in (("distill_compiled", "the student's decoder layers compiled"),
                       ("distill_compiled_teacher", "the teacher's compiled too"),
                       ("distill_bf16_weights", "and bf16 working weights")):
        if kind in best:
            c = best[kind]
            print(f"stage 2, {what} (best: batch {c['batch_size']}): {c['tokens_per_s']:,.0f} tokens/s "
                  f"= MFU {c['mfu']:.2%}")
    return out


if __name__ == "__main__":
    main()
