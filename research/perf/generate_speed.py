"""Speed of a hybrid's ``generate()``: the fast path (hybrid.generation: static cache, a CUDA graph on CUDA) vs
transformers' loop (``static_cache=False``), next to the bare decode step (``hybrid.decoding.Decoder``, timed as
research/bench_whole_model_gpu.py times it) and the teacher's own ``generate`` (dynamic cache, and transformers'
static cache, whose forward transformers compiles on CUDA: ``compiled`` in its row).

    python -m research.perf.generate_speed                      # CPU: the shipped reference model, its 7:1 mask
    python -m research.perf.generate_speed --device cuda --model smollm2-135m --prompt 8192 --new 128 --batch 1,32
    python -m research.perf.generate_speed --device cuda --compile-decode   # + the torch.compile'd step's rows
    python -m research.perf.generate_speed --device cuda --model smollm2-135m --prompt 8192 --new 128 --batch 32 \
        --skip eager,teacher_dynamic          # only the rows the targets need: bare step, fast, the faster teacher
    python -m research.perf.generate_speed --device cuda --model smollm2-135m --hybrid RUN/run/hybrid \
        --prompt 32768 --teacher-prompt 8192 --new 128 --batch 1 --skip eager,teacher_dynamic
                                              # a trained hybrid past the teacher's context, the teacher at its own

Per batch size and path: ``tok_s`` = B * new / the whole call (prefill included; the median of --repeats calls
after one untimed call, which captures the graph), ``step_ms`` = (call with ``new`` tokens - call with 1) /
(new - 1), the per-token cost without the prefill (CUDA: wall-clock; CPU: this process's CPU time, see
``clock``). ``fast_vs_step`` = the fast path's step_ms / the bare step
(target <= 1.10), ``fast_vs_eager`` = eager step_ms / fast step_ms (> 1: the fast path is faster). The teacher has
three rows: transformers' dynamic and static caches, and ``teacher_engine``, the teacher on the hybrid's own engine
(``hybrid.from_teacher``: every head FA, the same logits) through the same fast ``generate()``; ``best_teacher``
names the fastest by tokens/s and ``fast_vs_best_teacher`` is the hybrid's tokens/s over it. Prompts are
random token ids of --prompt tokens, greedy, EOS off, so every call makes exactly --new tokens. Writes the rows
to --out (default $OUT/generate_speed.json when $OUT is set) after each batch size, so a run cut by a time limit
keeps the batch sizes it finished. --skip leaves out slow rows (transformers' loop on the hybrid: ``eager``; the
teacher's dynamic cache: ``teacher_dynamic``; ``teacher_static``; ``teacher_engine``); the ratios that need a
skipped row are null.

``--hybrid FOLDER`` times a saved (trained) hybrid instead of the untrained one the mask builds; ``--teacher-prompt``
gives the teacher's rows their own prompt length (e.g. the teacher's longest context beside a hybrid that reads four
times as far). Each row records the decode cache's bytes at prompt + new positions (``hybrid.cache.cache_nbytes``:
``cache_bytes`` for the hybrid, FA keys/values + GDN states; ``teacher_cache_bytes`` for the teacher's KV cache at
its own prompt) and their ratio; ``--cache-only`` prints and writes those without timing anything (any machine):

    python -m research.perf.generate_speed --model smollm2-135m --mask research/train_hybrid/smollm2_broad_mask.json \
        --prompt 32768 --teacher-prompt 8192 --new 128 --batch 1 --dtype bfloat16 --cache-only
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from research.perf.benchmark import bench_ms, sync

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_MASKS = {  # the published 7:1 masks of the named models (docs/results/)
    "default": ROOT / "docs/results/2026-11-29_reference_head_report/reference_mask_7to1.json",
    "smollm2-135m": ROOT / "docs/results/2026-12-01_smollm2_head_report/mask_7to1.json",
}
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
SKIPPABLE = ("eager", "teacher_dynamic", "teacher_static", "teacher_engine")
TEACHER_ROWS = ("teacher_dynamic", "teacher_static", "teacher_engine")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="headscope.load_model name or folder (default: default)")
    p.add_argument("--mask", default=None, help="head-mask JSON (default: the model's shipped 7:1 mask, else a "
                                                "random 7:1 mask per layer, seed 0)")
    p.add_argument("--hybrid", default=None, help="a saved hybrid folder (hybrid.save; e.g. a run's run/hybrid) to "
                                                  "time instead of the untrained hybrid of --mask")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row (default 64)")
    p.add_argument("--teacher-prompt", type=int, default=None,
                   help="the teacher's prompt tokens per row (default: --prompt), e.g. its longest context")
    p.add_argument("--new", type=int, default=32, help="new tokens per row (default 32)")
    p.add_argument("--batch", default="1,4", help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="default: bfloat16 on cuda, float32 on the CPU")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median; default 3)")
    p.add_argument("--no-teacher", action="store_true", help="skip the teacher's generate")
    p.add_argument("--compile-decode", action="store_true",
                   help="also time the torch.compile'd decode step: bare_step_compiled_ms and fast_compiled "
                        "(generate(compile_decode=True)) next to the uncompiled rows")
    p.add_argument("--fused-gdn", action="store_true",
                   help="also time the fast path with the fused GDN decode op (hybrid.ops.gdn_decode; row "
                        "fast_fused_gdn beside fast, and its bare step)")
    p.add_argument("--pdl", action="store_true",
                   help="also time the fast path with programmatic dependent launch (generate(pdl_decode=True); "
                        "row fast_pdl, and fast_compiled_pdl with --compile-decode; compute capability 9.0+)")
    p.add_argument("--cache-only", action="store_true",
                   help="only the decode caches' bytes per batch size (nothing timed, nothing generated)")
    p.add_argument("--skip", default="", help=f"comma list of rows to leave out: {', '.join(SKIPPABLE)}")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/generate_speed.json when $OUT is set)")
    a = p.parse_args(argv)
    a.skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    if a.skip - set(SKIPPABLE):
        p.error(f"--skip: unknown row(s) {sorted(a.skip - set(SKIPPABLE))}; choose from {', '.join(SKIPPABLE)}")
    a.batches = [int(b) for b in a.batch.split(",") if b.strip()]
    if a.teacher_prompt is None:
        a.teacher_prompt = a.prompt
    if not a.batches or min(a.batches) < 1 or min(a.prompt, a.teacher_prompt) < 1 or a.new < 2 or a.repeats < 1:
        p.error("--batch sizes, --prompt, --teacher-prompt and --repeats must be >= 1 and --new >= 2")
    if a.hybrid is not None and a.mask is not None:
        p.error("give --hybrid (a trained hybrid, its mask inside) or --mask (an untrained one), not both")
    if a.hybrid is not None and not (Path(a.hybrid) / "config.json").is_file():
        p.error(f"--hybrid {a.hybrid}: no saved hybrid there (no config.json); give the folder hybrid.save wrote, "
                "e.g. a training run's run/hybrid")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return a


def build(model_name: str, mask_path: str | None, device: str, dtype: torch.dtype, saved: str | None = None):
    """(teacher, hybrid, the mask's description): the teacher and its hybrid (the saved one at ``saved``, else
    built from the mask), in eval mode on ``device``."""
    import headscope
    import hybrid

    teacher, _ = headscope.load_model(model_name)
    teacher = teacher.to(device=device, dtype=dtype).eval()
    if saved is not None:
        model = hybrid.load(saved).to(device=device, dtype=dtype).eval()
        if model.config.vocab_size != teacher.config.vocab_size:
            raise ValueError(f"--hybrid {saved}: its vocabulary ({model.config.vocab_size}) is not the teacher's "
                             f"({teacher.config.vocab_size}); give the --model it was converted from")
        return teacher, model, f"saved hybrid {saved}"
    path = mask_path or SHIPPED_MASKS.get(model_name)
    mask, what = None, None
    if path is not None and Path(path).exists():
        try:
            model = hybrid.from_mask(teacher, str(path))
            mask, what = path, str(Path(path).relative_to(ROOT) if Path(path).is_relative_to(ROOT) else path)
        except Exception as e:  # a mask for another model: say so and fall back to a random one
            if mask_path is not None:
                raise
            print(f"shipped mask {path} does not fit: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
    if mask is None:
        model = hybrid.from_mask(teacher, headscope.random_per_layer(teacher, ratio="7:1", seed=0))
        what = "random_per_layer 7:1 seed 0"
    return teacher, model.to(device=device, dtype=dtype).eval(), what


def clock(device: str):
    """Wall-clock on CUDA; on the CPU this process's CPU seconds (other processes' load does not count; with
    several intra-op threads their times add up, so compare runs with the same OMP_NUM_THREADS)."""
    return time.perf_counter if device == "cuda" else time.process_time


def timed_s(fn, device: str, repeats: int) -> float:
    """Median seconds of fn() over ``repeats`` calls, after one untimed call."""
    fn()
    now, times = clock(device), []
    for _ in range(repeats):
        sync(device)
        t = now()
        fn()
        sync(device)
        times.append(now() - t)
    return statistics.median(times)


def generate_row(model, ids: torch.Tensor, new: int, device: str, repeats: int, **kw) -> dict:
    """tok_s and step_ms of model.generate(ids, **kw) (see the module docstring)."""
    def call(n):
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **GREEDY, **kw)
        if out.shape[1] != ids.shape[1] + n:
            raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} tokens, not {n}")
        return out

    full = timed_s(lambda: call(new), device, repeats)
    one = timed_s(lambda: call(1), device, repeats)
    B = ids.shape[0]
    return dict(tok_s=round(B * new / full, 1), call_s=round(full, 4), prefill_s=round(one, 4),
                step_ms=round(1e3 * max(full - one, 0.0) / (new - 1), 3))


@contextlib.contextmanager
def fast_path_count():
    """A list that gets one entry per generate() call that ran hybrid.generation's fast path inside the block."""
    from hybrid import generation

    took, real = [], generation._fast_sample

    def counted(*a, **k):
        took.append(1)
        return real(*a, **k)

    generation._fast_sample = counted
    try:
        yield took
    finally:
        generation._fast_sample = real


def bare_step_ms(model, ids: torch.Tensor, new: int, device: str, compile: bool = False) -> float:
    """Median ms of one Decoder.step (CUDA graph on CUDA) on the prefilled rows: on CUDA timed as the
    whole-model benchmark (research.perf.benchmark.bench_ms), on the CPU with ``clock``."""
    from hybrid.decoding import Decoder, prefill

    reps = max(new, 8)
    cache, logits = prefill(model, list(ids), reps + 8, group=ids.shape[0])
    dec = Decoder(model, cache, compile=compile)
    nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
    if device == "cuda":
        return bench_ms(lambda: dec.step(nxt), device, target_ms=100.0, max_reps=reps, warmup=2)
    for _ in range(2):
        dec.step(nxt)
    now, times = clock(device), []
    for _ in range(reps):
        t = now()
        dec.step(nxt)
        times.append(1e3 * (now() - t))
    return statistics.median(times)


def teacher_rows(teacher, ids: torch.Tensor, new: int, device: str, repeats: int, skip=frozenset()) -> dict:
    """The teacher's generate with its dynamic cache and with transformers' static cache (sized once for both
    calls of generate_row through max_cache_len where transformers has it, so one compiled graph serves both)."""
    from transformers import GenerationConfig

    rows = {} if "teacher_dynamic" in skip else {"teacher_dynamic": generate_row(teacher, ids, new, device, repeats)}
    if "teacher_static" in skip:
        return rows
    static = dict(cache_implementation="static")
    if hasattr(GenerationConfig(), "max_cache_len"):
        static["max_cache_len"] = ids.shape[1] + new
    try:
        rows["teacher_static"] = generate_row(teacher, ids, new, device, repeats, **static)
        # transformers compiles the static-cache forward itself where it can (on CUDA)
        rows["teacher_static"]["compiled"] = getattr(teacher, "_compiled_call", None) is not None
    except Exception as e:  # not every transformers / torch build compiles every model: recorded, not fatal
        rows["teacher_static"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return rows


def teacher_engine_row(teacher, ids: torch.Tensor, new: int, device: str, repeats: int) -> dict:
    """The teacher on the hybrid's engine (``hybrid.from_teacher``: every head FA, RoPE kept, the teacher's logits)
    through the hybrid's fast ``generate()``: the same static cache, decode attention and CUDA graph as the hybrid."""
    import hybrid

    engine = hybrid.from_teacher(teacher).to(device=device, dtype=next(teacher.parameters()).dtype).eval()
    with fast_path_count() as took:
        r = generate_row(engine, ids, new, device, repeats)
    if not took:
        raise RuntimeError("the teacher's engine generate() did not take the fast path")
    del engine
    return r


def best_teacher(row: dict) -> tuple[str | None, float | None]:
    """(name, the hybrid's fast tokens/s over it) of the teacher row with the most tokens/s, or (None, None)."""
    timed = {k: row[k]["tok_s"] for k in TEACHER_ROWS if "tok_s" in row.get(k, {})}
    if not timed:
        return None, None
    name = max(timed, key=timed.get)
    return name, round(row["fast"]["tok_s"] / timed[name], 3)


def run(args: argparse.Namespace, out: str | None = None) -> dict:
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    torch.manual_seed(0)
    teacher, model, mask = build(args.model, args.mask, args.device, dtype, args.hybrid)
    vocab = model.config.vocab_size
    result = dict(model=args.model, mask=mask, device=args.device, dtype=str(dtype).replace("torch.", ""),
                  prompt=args.prompt, teacher_prompt=args.teacher_prompt, new=args.new, repeats=args.repeats,
                  threads=torch.get_num_threads(), torch=torch.__version__, rows=[])
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    for B in args.batches:
        ids = torch.randint(3, vocab, (B, args.prompt), generator=torch.Generator().manual_seed(B)).to(args.device)
        row = dict(batch=B, **cache_bytes(model, teacher, args.prompt + args.new, args.teacher_prompt + args.new, B,
                                          dtype))
        if args.cache_only:
            result["rows"].append(row)
            print(cache_line(row, args), flush=True)
            if out:
                write(out, result)
            continue
        with torch.no_grad():
            row["bare_step_ms"] = round(bare_step_ms(model, ids, args.new, args.device), 3)
        with fast_path_count() as took:
            row["fast"] = generate_row(model, ids, args.new, args.device, args.repeats)
        if not took:  # the row would time transformers' loop under the fast path's name
            raise RuntimeError("generate() did not take the fast path (hybrid.generation logs why at INFO)")
        if args.fused_gdn:
            from hybrid.layers.hybrid_attention import use_fused_decode

            use_fused_decode(model)
            try:
                with torch.no_grad():
                    row["bare_step_fused_gdn_ms"] = round(bare_step_ms(model, ids, args.new, args.device), 3)
                row["fast_fused_gdn"] = generate_row(model, ids, args.new, args.device, args.repeats)
            finally:
                use_fused_decode(model, on=False)
        if "eager" not in args.skip:
            row["eager"] = generate_row(model, ids, args.new, args.device, args.repeats, static_cache=False)
        if args.compile_decode:
            with torch.no_grad():
                row["bare_step_compiled_ms"] = round(bare_step_ms(model, ids, args.new, args.device, True), 3)
            row["fast_compiled"] = generate_row(model, ids, args.new, args.device, args.repeats, compile_decode=True)
        if args.pdl:
            row["fast_pdl"] = generate_row(model, ids, args.new, args.device, args.repeats, pdl_decode=True)
            if args.compile_decode:
                row["fast_compiled_pdl"] = generate_row(model, ids, args.new, args.device, args.repeats,
                                                        compile_decode=True, pdl_decode=True)
        if not args.no_teacher:
            t_ids = ids if args.teacher_prompt == args.prompt else torch.randint(
                3, vocab, (B, args.teacher_prompt), generator=torch.Generator().manual_seed(B)).to(args.device)
            row.update(teacher_rows(teacher, t_ids, args.new, args.device, args.repeats, args.skip))
            if "teacher_engine" not in args.skip:
                row["teacher_engine"] = teacher_engine_row(teacher, t_ids, args.new, args.device, args.repeats)
        fast, eager = row["fast"]["step_ms"], row.get("eager", {}).get("step_ms")
        row["fast_vs_step"] = round(fast / row["bare_step_ms"], 3) if row["bare_step_ms"] else None
        row["fast_vs_eager"] = round(eager / fast, 3) if fast and eager else None
        row["tok_s_fast_vs_eager"] = round(row["fast"]["tok_s"] / row["eager"]["tok_s"], 3) if eager else None
        static = row.get("teacher_static", {}).get("step_ms")
        row["teacher_static_vs_fast"] = round(static / fast, 3) if fast and static else None
        row["best_teacher"], row["fast_vs_best_teacher"] = best_teacher(row)
        result["rows"].append(row)
        print(line(row), flush=True)
        if out:
            write(out, result)
    return result


def cache_bytes(model, teacher, positions: int, teacher_positions: int, batch: int, dtype: torch.dtype) -> dict:
    """The decode caches' bytes (``hybrid.cache``'s analytic counts, as the static cache allocates them): the
    hybrid's at ``positions`` (FA keys/values, GDN and conv states), the teacher's KV cache at
    ``teacher_positions``, and hybrid / teacher."""
    from hybrid.cache import cache_nbytes, teacher_cache_nbytes

    mine = cache_nbytes(model, positions, batch, dtype)["total"]
    theirs = teacher_cache_nbytes(teacher, teacher_positions, batch, dtype)
    return dict(cache_bytes=mine, teacher_cache_bytes=theirs, cache_vs_teacher=round(mine / theirs, 4))


def cache_line(row: dict, args: argparse.Namespace) -> str:
    return (f"B={row['batch']}: hybrid cache at {args.prompt} + {args.new} positions {row['cache_bytes'] / 2**20:.1f} "
            f"MiB; teacher's at {args.teacher_prompt} + {args.new} {row['teacher_cache_bytes'] / 2**20:.1f} MiB; "
            f"hybrid / teacher {row['cache_vs_teacher']}")


def write(out: str, result: dict) -> None:
    from headscope.io import write_text

    write_text(Path(out), json.dumps(result, indent=1))


def line(row: dict) -> str:
    parts = [f"B={row['batch']}: bare step {row['bare_step_ms']:.3f} ms",
             f"cache {row['cache_bytes'] / 2**20:.1f} MiB (teacher {row['teacher_cache_bytes'] / 2**20:.1f} MiB, "
             f"x{row['cache_vs_teacher']})"]
    if "bare_step_compiled_ms" in row:
        parts.append(f"compiled bare step {row['bare_step_compiled_ms']:.3f} ms")
    if "bare_step_fused_gdn_ms" in row:
        parts.append(f"fused-GDN bare step {row['bare_step_fused_gdn_ms']:.3f} ms")
    for name in ("fast", "fast_fused_gdn", "fast_compiled", "fast_pdl", "fast_compiled_pdl", "eager") + TEACHER_ROWS:
        r = row.get(name)
        if r is None:
            continue
        parts.append(f"{name} {r['tok_s']:.0f} tok/s, {r['step_ms']:.3f} ms/step" if "tok_s" in r
                     else f"{name} {r['error'][:80]}")
    parts.append(f"fast/bare step {row['fast_vs_step']}, eager/fast step {row['fast_vs_eager']}, "
                 f"fast/eager tok/s {row['tok_s_fast_vs_eager']}, teacher_static/fast step "
                 f"{row['teacher_static_vs_fast']}, fast / best teacher ({row['best_teacher']}) tok/s "
                 f"{row['fast_vs_best_teacher']}")
    return "; ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out or (str(Path(os.environ["OUT"]) / "generate_speed.json") if os.environ.get("OUT") else None)
    run(args, out)
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
