"""Whole-model cost of the hybrids at long context, in ONE process under a wall-clock budget.

Models (random weights, bf16, built on the GPU; no download):
  teacher      a Qwen3-1.7B-shaped model (28 layers, 16 query / 8 KV heads of 128, hidden 2048, MLP 6144,
               vocab 151936) as a HybridForCausalLM (hybrid.from_teacher: every head FA with RoPE, logits equal
               to the HF model's), so all three run the same code, cache class and decode loop
  hybrid_7to1  head-level 7:1: per layer 2 query heads sharing one KV head keep FA (1/8 of the KV cache)
  layer_3to1   layer-wise 3:1: FA layers 3, 7, ..., 27, the others all GDN

Measured, most important first (each unit is skipped, with the reason recorded, when its estimate no longer
fits --budget-s):
  1. decode time per step (one token per row, hybrid.decoding.Decoder: preallocated StaticHybridCache, CUDA
     graph unless --no-cuda-graph, plus a few eager steps for comparison) at 128K then 32K context, batch 8 and 1;
     --fused-gdn adds the hybrids' step with the fused GDN decode op (fused_gdn_ms), --compile-decode the compiled one
     (compiled_ms), both together also the fused op inside the compiled step (compiled_fused_ms); --best-only
     times only each model's fastest of those (one compile per row).
     --hf-teacher adds the teacher on transformers' own static cache, compiled as its generate() compiles it
     (hf_static_ms): the other teacher every decode ratio is taken against the faster of.
     The cache rows are set to the context length without a prefill (a step's cost depends on the lengths, not
     on the values; the ragged prefill path is tested on the CPU);
  2. prefill time (logits of the last position only, the cache kept) and peak memory at 128K, 64K, 32K, 16K
     (peak_gb: the allocator's peak above the resident weights plus this model's own weights);
  3. cache bytes per sequence at 128K: measured (StaticHybridCache.nbytes) vs the analytic hybrid.cache_nbytes
     and vs (FA KV groups' share x teacher KV + GDN state);
  4. the largest batch that fits at 128K (analytic guess from the free memory, then allocate + one decode step,
     bisecting on CUDA out-of-memory), with all three models' weights resident (recorded) for every model;
  5. one layer at 128K, forward with projections: the 7:1 layer (fused Triton prologue, and the PyTorch
     prologue) vs the 16-head full-attention layer (research.perf.benchmark.build_layers, as gpu_hybrid_all.py).

Run (GPU machine; fla-core carried as a wheel, see docs/hybrid.md "Whole-model benchmark"):
    PYTHONPATH=/tmp/site:$PWD python3 research/bench_whole_model_gpu.py --budget-s 450
CPU check of the logic (tiny model, float32, emulated memory cap): python research/bench_whole_model_gpu.py --dry-run
Writes $OUT/bench_whole_model.json (--out to override), rewritten after every row;
python research/render_whole_model.py renders it into docs/hybrid.md's table.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

from headscope.heads import Head
from headscope.mask import HeadMask
from research.perf.benchmark import Run, bench_ms, build_layers, inductor_options, layer_forward_ms, sync
from hybrid.cache import cache_nbytes, teacher_cache_nbytes
from hybrid.convert import from_mask
from hybrid.decoding import Decoder, StaticHybridCache
from hybrid.layers.common import use_decode_gemv
from hybrid.layers.hybrid_attention import use_fused_decode
from hybrid.builders import from_teacher, layerwise_mask

GPU_SHAPE = dict(vocab=151936, C=2048, I=6144, L=28, H=16, K=8, D=128)
DRY_SHAPE = dict(vocab=256, C=64, I=128, L=4, H=16, K=8, D=16)
TARGETS = dict(decode_speedup_b8_128k=5.0, decode_speedup_b1_128k=2.5, max_batch_ratio_128k=6.0,
               cache_bytes_rel_err=0.05, prefill_speedup_128k=3.0, layer_fwd_speedup_128k=4.5)
MODELS = ("teacher", "hybrid_7to1", "layer_3to1")


def build_models(shape: dict, device: str, dtype: torch.dtype, keep_hf: bool = False) -> dict:
    """The three models of the module docstring (random weights; the HF teacher is dropped after conversion unless
    ``keep_hf``: then it is the dict's ``HF_TEACHER`` entry, for transformers' own decode step)."""
    from headscope.synthetic import random_qwen3

    hf = random_qwen3(dict(vocab=shape["vocab"], hidden=shape["C"], intermediate=shape["I"], layers=shape["L"],
                           heads=shape["H"], kv_heads=shape["K"], head_dim=shape["D"]), device=device, dtype=dtype,
                      max_position_embeddings=262144, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      rms_norm_eps=1e-6)
    with torch.device(device):
        rep = shape["H"] // shape["K"]
        # 7:1 with whole KV groups: layer l keeps the `rep` query heads of KV head (3 l) mod K (1/K of the KV)
        fa = [Head(layer=l, head=(3 * l) % shape["K"] * rep + r) for l in range(shape["L"]) for r in range(rep)]
        models = {
            "teacher": from_teacher(hf),
            "hybrid_7to1": from_mask(hf, HeadMask.for_model(hf, fa)),
            "layer_3to1": from_mask(hf, layerwise_mask(hf, "3:1"), granularity="layer"),
        }
    if keep_hf:
        models[HF_TEACHER] = hf
    del hf
    for m in models.values():
        m.eval().requires_grad_(False)
    return models


HF_TEACHER = "hf_teacher"  # build_models(keep_hf=True): the transformers teacher the engine's teacher came from


def hf_static_step(hf, batch: int, ctx: int, capacity: int, vocab: int, device: str, compiled: bool):
    """transformers' own decode step of the teacher: its ``StaticCache`` (``max_cache_len=capacity``) with every
    layer's length set to ``ctx`` without a prefill (a step's cost depends on the lengths, not the values: its
    attention reads the whole static buffer under a mask), one token per row, compiled on CUDA as transformers
    compiles the static-cache forward for ``generate`` (``mode="reduce-overhead"``: CUDA graphs). Returns
    ``step()``, which advances the positions by one each call (``step.cache``, ``step.ids``, ``step.cache_kwarg``:
    its cache, its input [B, 1] and the forward's name for the cache)."""
    import inspect

    from transformers import StaticCache

    params = inspect.signature(hf.forward).parameters
    kw = "cache" if "cache" in params else "past_key_values"  # transformers renamed it after 5.17
    cache = StaticCache(config=hf.config, max_cache_len=capacity)
    ids = torch.randint(0, vocab, (batch, 1), device=device)  # [B, 1]
    with torch.no_grad():
        hf(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})  # allocates every layer's buffers
    for layer in cache.layers:
        if not hasattr(layer, "cumulative_length"):
            raise RuntimeError(f"transformers' {type(layer).__name__} has no cumulative_length (this transformers "
                               "keeps a static cache's length elsewhere): hf_static_step needs updating for it")
        layer.cumulative_length.fill_(ctx)
    pos = torch.full((batch, 1), ctx, device=device, dtype=torch.long)  # [B, 1]: the next position
    fwd = torch.compile(hf.forward, mode="reduce-overhead") if compiled else hf.forward

    def step() -> torch.Tensor:
        with torch.no_grad():
            logits = fwd(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **{kw: cache}).logits
        pos.add_(1)
        return logits  # [B, 1, V]

    step.cache, step.ids, step.cache_kwarg = cache, ids, kw
    return step


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def round_up(n: int, m: int = 64) -> int:
    return -(-n // m) * m


def filled_cache(model, batch: int, ctx: int, capacity: int) -> StaticHybridCache:
    """A StaticHybridCache whose rows already hold `ctx` positions (zeros: a step's cost depends on lengths)."""
    return rewind(StaticHybridCache.allocate(model, batch, capacity), ctx)


def rewind(cache: StaticHybridCache, ctx: int) -> StaticHybridCache:
    """Set every row of ``cache`` back to ``ctx`` positions in place (the addresses a CUDA graph holds stay), so
    each timed column starts from the same context and the columns together never outgrow the capacity."""
    cache.lengths.fill_(ctx)
    cache.host_lengths = [ctx] * cache.lengths.shape[0]
    cache.seen_tokens = ctx
    return cache


# ---------------------------------------------------------------- 1. decode


def timed_column(run: Run, row: dict, key: str, what: str, make, ids, steps: int, cache=None) -> None:
    """row[f"{key}_ms"] = the median step of the Decoder ``make()`` builds, from the row's context (``cache``
    rewound to it first); a failure other than running out of memory is a finding, not the end of the run:
    row[f"{key}_error"], said, and the other columns stand."""
    try:
        if cache is not None:
            rewind(cache, row["context"])
        dec = make()
        row[f"{key}_ms"] = round(bench_ms(lambda: dec.step(ids), run.device, target_ms=200.0, max_reps=steps), 3)
        del dec
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        run.say(f"{what} failed for {row['model']} ctx={row['context']} B={row['batch']}: {row[f'{key}_error']}")


def decode_row(run: Run, name: str, model, ctx: int, batch: int, steps: int, graph: bool, vocab: int,
               compiled: bool = False, fused: bool = False, hf=None, best_only: bool = False,
               compile_mode: str = "default", compile_options: dict | None = None, pdl: bool = False,
               gemv: bool = False) -> dict:
    """One (model, context, batch) row: the eager step, then each path asked for. ``best_only`` (with
    ``compiled``) times only each model's fastest path: the compiled step with the fused GDN op where the model
    has GDN heads and ``fused``, the compiled step otherwise (one compile per row instead of up to three).
    ``compile_mode`` and ``compile_options`` (inductor's settings by name): torch.compile's for every compiled column
    (teacher and hybrids alike); ``pdl``: every column but the eager one with programmatic dependent launch
    (``Decoder(pdl=True)``); ``gemv``: every column with the projections as the decode GEMV
    (``hybrid.layers.common.use_decode_gemv``), the teacher's too."""
    use_decode_gemv(model, gemv)
    try:
        return _decode_row(run, name, model, ctx, batch, steps, graph, vocab, compiled, fused, hf, best_only,
                           compile_mode, compile_options, pdl)
    finally:
        use_decode_gemv(model, False)


def _decode_row(run, name, model, ctx, batch, steps, graph, vocab, compiled, fused, hf, best_only, compile_mode,
                compile_options, pdl) -> dict:
    dev = run.device
    fusable = fused and use_fused_decode(model, False) > 0  # GDN branches to switch (split path until then)
    if best_only and compiled:
        graph_col, compiled_col, fused_col = False, not fusable, False
    else:
        graph_col, compiled_col, fused_col = graph, compiled, True
    capacity = round_up(ctx + steps + 16)
    cache = filled_cache(model, batch, ctx, capacity)
    ids = torch.randint(0, vocab, (batch, 1), device=dev)  # [B, 1]
    row = dict(model=name, context=ctx, batch=batch)
    try:
        eager = Decoder(model, cache, cuda_graph=False)
        row["eager_ms"] = round(bench_ms(lambda: eager.step(ids), dev, target_ms=100.0, max_reps=5), 3)
        if graph_col:
            timed_column(run, row, "graph", "CUDA graph capture",
                         lambda: Decoder(model, cache, cuda_graph=True, pdl=pdl), ids, steps, cache=cache)
        if compiled_col:  # the torch.compile'd step (inside the graph on CUDA): its own column, never the step_ms
            timed_column(run, row, "compiled", "compiled step",
                         lambda: Decoder(model, cache, cuda_graph=graph, compile=True, compile_mode=compile_mode,
                                         compile_options=compile_options, pdl=pdl), ids, steps, cache=cache)
        if fusable:  # the fused GDN decode op (hybrid.ops.gdn_decode): own column
            use_fused_decode(model, True)
            try:
                if fused_col:
                    timed_column(run, row, "fused_gdn", "fused GDN step",
                                 lambda: Decoder(model, cache, cuda_graph=graph, pdl=pdl), ids, steps,
                                 cache=cache)
                if compiled:  # both: the fused op inside the compiled step
                    timed_column(run, row, "compiled_fused", "compiled step with the fused GDN op",
                                 lambda: Decoder(model, cache, cuda_graph=graph, compile=True,
                                                 compile_mode=compile_mode, compile_options=compile_options,
                                                 pdl=pdl), ids, steps, cache=cache)
            finally:
                use_fused_decode(model, False)
        row["step_ms"] = row.get("graph_ms", row["eager_ms"])
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e)[:120]}"
    del cache
    free(dev)
    if hf is not None:  # the teacher's second engine: transformers' static cache, its own buffers (after ours went)
        hf_column(run, row, hf, ctx, batch, steps, vocab, compiled=dev == "cuda")
    return row


def hf_column(run: Run, row: dict, hf, ctx: int, batch: int, steps: int, vocab: int, compiled: bool) -> None:
    """row["hf_static_ms"]: transformers' compiled static-cache step (``hf_static_step``) at the row's context, the
    median after three untimed steps (compiling and recording the CUDA graphs); a failure is recorded, not raised."""
    try:
        step = hf_static_step(hf, batch, ctx, round_up(ctx + steps + 32), vocab, run.device, compiled)
        for _ in range(3):
            step()
        row["hf_static_ms"] = round(bench_ms(step, run.device, target_ms=200.0, max_reps=steps), 3)
        row["hf_static_compiled"] = compiled
        del step
    except Exception as e:  # out of memory included: the engine's columns stand
        row["hf_static_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        run.say(f"transformers' static-cache step failed for ctx={ctx} B={batch}: {row['hf_static_error']}")
    free(run.device)


SECTIONS = ("decode", "prefill", "max_batch", "layer")  # --sections: most important first


def decode_section(run: Run, models: dict, contexts: list[int], batches: list[int], steps: int, graph: bool,
                   vocab: int, est) -> None:
    for ctx in contexts:
        for batch in batches:
            for name in MODELS:
                label = f"decode {name} ctx={ctx} B={batch}"
                if not run.fits(label, est(name, ctx, batch)):
                    continue
                row = decode_row(run, name, models[name], ctx, batch, steps, graph, vocab,
                                 compiled=run.data.get("compile_decode", False),
                                 fused=run.data.get("fused_gdn", False), best_only=run.data.get("best_only", False),
                                 compile_mode=run.data.get("compile_mode", "default"),
                                 compile_options=run.data.get("compile_options") or None,
                                 pdl=run.data.get("pdl", False), gemv=run.data.get("gemv", False),
                                 hf=models.get(HF_TEACHER) if name == "teacher" else None)
                run.data["decode"].append(row)
                run.say(f"{label}: {row}")
                run.save()
            base = next((r for r in run.data["decode"] if r["model"] == "teacher" and r["context"] == ctx
                         and r["batch"] == batch and "step_ms" in r), None)
            for r in run.data["decode"]:
                if base and r["context"] == ctx and r["batch"] == batch and "step_ms" in r:
                    r["speedup_vs_teacher"] = round(base["step_ms"] / r["step_ms"], 2)
                    if r.get("fused_gdn_ms"):
                        r["fused_speedup_vs_teacher"] = round(base["step_ms"] / r["fused_gdn_ms"], 2)
            run.save()


# ---------------------------------------------------------------- 2. prefill


def prefill_row(run: Run, name: str, model, T: int, vocab: int) -> dict:
    dev = run.device
    ids = torch.randint(0, vocab, (1, T), device=dev)  # [B, T]
    row = dict(model=name, T=T)

    def call():
        with torch.no_grad():
            return model(ids, use_cache=True, logits_to_keep=1)

    try:
        free(dev)
        base = torch.cuda.memory_allocated() if dev == "cuda" else 0
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        out = call()  # first call: compiles / autotunes; also gives the peak
        sync(dev)
        if dev == "cuda":  # the three models stay resident: peak_gb counts only this model's own weights
            own = sum(p.numel() * p.element_size() for p in model.parameters())
            extra = torch.cuda.max_memory_allocated() - base
            row["peak_over_weights_gb"] = round(extra / 2**30, 3)
            row["peak_gb"] = round((extra + own) / 2**30, 3)
            row["peak_all_resident_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        row["cache_bytes"] = out.hybrid_cache.nbytes()["total"]
        del out
        row["ms"] = round(bench_ms(call, dev, target_ms=300.0, max_reps=5, warmup=0), 2)
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e)[:120]}"
    del ids
    free(dev)
    return row


def prefill_section(run: Run, models: dict, lengths: list[int], vocab: int, est) -> None:
    for T in lengths:
        for name in MODELS:
            label = f"prefill {name} T={T}"
            if not run.fits(label, est(name, T)):
                continue
            row = prefill_row(run, name, models[name], T, vocab)
            run.data["prefill"].append(row)
            run.say(f"{label}: {row}")
            run.save()
        base = next((r for r in run.data["prefill"] if r["model"] == "teacher" and r["T"] == T and "ms" in r), None)
        for r in run.data["prefill"]:
            if base and r["T"] == T and "ms" in r:
                r["speedup_vs_teacher"] = round(base["ms"] / r["ms"], 2)
                if "peak_gb" in r:
                    r["peak_vs_teacher"] = round(r["peak_gb"] / base["peak_gb"], 3)
        run.save()


# ---------------------------------------------------------------- 3. cache bytes, 4. max batch


def cache_section(run: Run, models: dict, ctx: int, dtype: torch.dtype) -> None:
    teacher_cfg = models["teacher"].config
    t_kv = teacher_cache_nbytes(teacher_cfg, ctx, 1, dtype)
    for name in MODELS:
        model = models[name]
        cache = StaticHybridCache.allocate(model, 1, ctx)
        measured = cache.nbytes()
        del cache
        free(run.device)
        analytic = cache_nbytes(model, ctx, 1, dtype)
        cfg = model.config
        share = sum(len(cfg.fa_kv_heads(l)) for l in range(cfg.num_hidden_layers)) / (
            cfg.num_hidden_layers * cfg.num_key_value_heads)
        formula = share * t_kv + analytic["gdn_state"] + analytic["conv_state"]
        row = dict(model=name, context=ctx, measured_bytes=measured["total"], analytic_bytes=analytic["total"],
                   fa_kv_bytes=measured["fa_kv"], gdn_state_bytes=measured["gdn_state"], kv_share=round(share, 4),
                   formula_bytes=int(formula), rel_err_vs_formula=round(abs(measured["total"] - formula) / formula, 5),
                   teacher_over_this=round(t_kv / measured["total"], 2))
        run.data["cache_bytes"].append(row)
        run.say(f"cache bytes/sequence {name} at {ctx}: {row}")
    run.save()


def batch_fits(run: Run, model, batch: int, ctx: int, vocab: int, mem_cap: int | None) -> bool:
    """Allocate the cache for `batch` rows at `ctx` and run one eager decode step; False on out-of-memory."""
    cache = None
    try:
        if mem_cap is not None:  # emulated device memory (CPU dry run)
            need = cache_nbytes(model, ctx + 1, batch, next(model.parameters()).dtype)["total"]
            if need > mem_cap:
                raise torch.OutOfMemoryError(f"emulated: {need} B > cap {mem_cap} B")
        cache = filled_cache(model, batch, ctx, ctx + 1)
        Decoder(model, cache, cuda_graph=False).step(torch.zeros(batch, 1, dtype=torch.long, device=run.device))
        sync(run.device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del cache
        free(run.device)


def max_batch_section(run: Run, models: dict, ctx: int, vocab: int, mem_cap: int | None, limit: int) -> None:
    for name in MODELS:
        model = models[name]
        if not run.fits(f"max batch {name} ctx={ctx}", 40.0 if run.device == "cuda" else 5.0):
            continue
        per_seq = cache_nbytes(model, ctx + 1, 1, next(model.parameters()).dtype)["total"]
        avail = mem_cap if mem_cap is not None else torch.cuda.mem_get_info()[0]
        guess = max(1, min(limit, avail // per_seq))
        tried = []

        def fits(b: int) -> bool:
            ok = batch_fits(run, model, b, ctx, vocab, mem_cap)
            tried.append((b, ok))
            return ok

        lo, hi = 0, guess  # lo fits (0 trivially), hi does not (unless it is tried and fits)
        if fits(guess):
            lo, step = guess, max(1, guess // 16)
            while lo + step <= limit and fits(lo + step):  # the analytic guess ignores activations: grow
                lo += step
            hi = min(lo + step, limit + 1)
        while hi - lo > 1:  # bisect: lo fits, hi does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        row = dict(model=name, context=ctx, max_batch=lo, analytic_guess=int(guess), tried=tried,
                   free_bytes=int(avail), per_seq_bytes=int(per_seq), hit_limit=lo >= limit,
                   resident_weights_gb=round(sum(p.numel() * p.element_size() for m in models.values()
                                                 for p in m.parameters()) / 2**30, 2))
        run.data["max_batch"].append(row)
        run.say(f"max batch {name} at {ctx}: {lo} (guess {guess}, tried {tried})")
        run.save()
    base = next((r["max_batch"] for r in run.data["max_batch"] if r["model"] == "teacher"), None)
    for r in run.data["max_batch"]:
        if base:
            r["ratio_vs_teacher"] = round(r["max_batch"] / base, 2)
    run.save()


# ---------------------------------------------------------------- 5. one layer


def layer_section(run: Run, shape: dict, T: int, dtype: torch.dtype) -> None:
    """One 7:1 layer (2 FA heads on one KV head) vs the 16-head layer, forward with projections."""
    lshape = dict(C=shape["C"], H=shape["H"], K=shape["K"], D=shape["D"], fa_heads=[2, 3])
    row = dict(T=T, fa_heads=[2, 3])
    for prologue in ("triton", "torch"):
        if prologue == "triton" and run.device != "cuda":
            continue
        cfg, hybrid, full = build_layers(lshape, run.device, dtype, "auto", "auto", prologue_backend=prologue)
        try:
            row[f"hybrid_fwd_ms[{prologue}_prologue]"] = round(layer_forward_ms(hybrid, cfg, T, run.device, dtype), 3)
            if "full16_fwd_ms" not in row:
                row["full16_fwd_ms"] = round(layer_forward_ms(full, cfg, T, run.device, dtype), 3)
        except torch.OutOfMemoryError as e:
            row[f"error[{prologue}]"] = str(e)[:120]
        del hybrid, full
        free(run.device)
    best = min(v for k, v in row.items() if k.startswith("hybrid_fwd_ms"))
    row["fwd_speedup"] = round(row["full16_fwd_ms"] / best, 2)
    run.data["layer"].append(row)
    run.say(f"one layer at T={T}: {row}")
    run.save()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget; later units are skipped")
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (float32), emulated memory cap")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/bench_whole_model.json)")
    ap.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly only")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per row")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="prefill lengths, first = the longest")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="decode contexts, first = the longest")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes")
    ap.add_argument("--compile-decode", action="store_true",
                    help="also time the torch.compile'd decode step (column compiled_ms)")
    ap.add_argument("--fused-gdn", action="store_true",
                    help="also time the hybrids' step with the fused GDN decode op (hybrid.ops.gdn_decode; columns "
                         "fused_gdn_ms and fused_speedup_vs_teacher; step_ms stays the split path's)")
    ap.add_argument("--hf-teacher", action="store_true",
                    help="also time the teacher on transformers' own static cache, compiled on CUDA as its "
                         "generate() compiles it (column hf_static_ms of the teacher's decode rows)")
    ap.add_argument("--best-only", action="store_true",
                    help="with --compile-decode: time only each model's fastest decode path (the compiled step, with "
                         "the fused GDN op where --fused-gdn and the model has GDN heads) beside the eager step: one "
                         "compile per row, so that 128K and 32K fit one command")
    ap.add_argument("--compile-mode", default="default",
                    help="with --compile-decode: torch.compile's mode for every compiled step, teacher and hybrids "
                         "(e.g. max-autotune-no-cudagraphs: inductor picks each GEMM among cuBLAS and its Triton "
                         "templates; the step's own CUDA graph stays the Decoder's)")
    ap.add_argument("--inductor", action="append", default=None, metavar="KEY=VALUE",
                    help="with --compile-decode: an inductor setting for every compiled step, teacher and hybrids "
                         "(repeatable), e.g. combo_kernels=true: independent small kernels launched as one")
    ap.add_argument("--pdl", action="store_true",
                    help="every decode column but the eager one with programmatic dependent launch (Decoder(pdl=True): "
                         "the project's decode kernels and, compiled, inductor's on a GPU of compute capability 9.0+; "
                         "recorded as pdl, with pdl_used where the device has it)")
    ap.add_argument("--gemv", action="store_true",
                    help="every decode column with each model's projections (decoder layers and output head) as the "
                         "project's decode GEMV kernel (hybrid.ops.gemv; use_decode_gemv), the teacher's too; "
                         "recorded as gemv")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma list of the units to run, of {', '.join(SECTIONS)} (default all; the cache bytes "
                         "always run: they are instant)")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        ap.error(f"--sections {args.sections!r}: unknown {unknown or 'nothing given'}; choose from {', '.join(SECTIONS)}")
    if args.best_only and not args.compile_decode:
        ap.error("--best-only times the compiled step only: add --compile-decode")
    if args.compile_mode != "default" and not args.compile_decode:
        ap.error(f"--compile-mode {args.compile_mode} sets the compiled step's mode: add --compile-decode")
    if args.inductor and not args.compile_decode:
        ap.error("--inductor sets the compiled step's settings: add --compile-decode")
    try:
        compile_options = inductor_options(args.inductor, args.compile_mode)  # an unknown setting: refused now
    except ValueError as err:
        ap.error(str(err))
    out = args.out or Path(os.environ.get("OUT", ".")) / "bench_whole_model.json"
    if args.dry_run:
        device, dtype, shape = "cpu", torch.float32, DRY_SHAPE
        lengths, contexts, batches, steps = [128, 64], [64, 32], [2, 1], args.steps or 3
        big, mem_cap, limit, layer_T = 64, 2 * 2**20, 256, 128
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --dry-run)")
        device, dtype, shape = "cuda", torch.bfloat16, GPU_SHAPE
        lengths, contexts, batches, steps = [131072, 65536, 32768, 16384], [131072, 32768], [8, 1], args.steps or 20
        big, mem_cap, limit, layer_T = 131072, None, 512, 131072
    lengths, contexts, batches = args.lengths or lengths, args.contexts or contexts, args.batches or batches
    big = contexts[0]
    run = Run(args.budget_s, out, device, shape=shape, targets=TARGETS, decode=[], prefill=[], cache_bytes=[],
              max_batch=[], layer=[], dry_run=args.dry_run, cuda_graph=not args.no_cuda_graph and device == "cuda",
              compile_decode=args.compile_decode, fused_gdn=args.fused_gdn, hf_teacher=args.hf_teacher,
              best_only=args.best_only, compile_mode=args.compile_mode, compile_options=compile_options,
              pdl=args.pdl, gemv=args.gemv)
    from hybrid.ops import parity
    from hybrid.ops.gdn import fla_available

    run.data["environment"] = parity.environment()
    run.data["fla"] = device == "cuda" and fla_available()
    if args.pdl:  # whether the device takes it (compute capability 9.0+); elsewhere --pdl changes nothing
        from hybrid.decoding import inductor_pdl_options
        from hybrid.ops.utils import pdl_supported

        run.data["pdl_used"] = pdl_supported(torch.empty(0, device=device))
        run.data["inductor_pdl"] = bool(inductor_pdl_options())  # this torch's inductor takes part (compiled)
    run.say(f"environment {run.data['environment']}; fla {run.data['fla']}; writing {out}")
    if device == "cuda" and not run.data["fla"]:
        run.say("WARNING: fla not importable: GDN runs the PyTorch twins (slow); carry the fla-core wheel")
    models = build_models(shape, device, dtype, keep_hf=args.hf_teacher)
    run.data["params"] = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items() if k != HF_TEACHER}
    run.say(f"built {run.data['params']}")
    run.save()
    gpu = device == "cuda"
    cache_section(run, models, big, dtype)

    # rough cost estimates (s) for the budget: GPU from H200 rates (KV read ~3 TB/s, 16-head layer ~135 ms at
    # 128K, quadratic), plus compile/autotune for first calls; CPU dry run: a few seconds
    def dec_est(name, ctx, batch):
        if not gpu:
            return 3.0
        kv = cache_nbytes(models[name], ctx, batch)["total"]
        return 8.0 + (steps + 8) * (kv / 2.5e12 + 0.01)

    def pre_est(name, T):
        if not gpu:
            return 3.0
        full = 28 * 0.15 * (T / 131072) ** 2 + 28 * 0.02 * T / 131072  # teacher forward, s
        frac = {"teacher": 1.0, "hybrid_7to1": 0.35, "layer_3to1": 0.35}[name]
        return 3 * full * frac + 10.0

    graph = run.data["cuda_graph"]
    # most important first: the targets (decode, prefill, max batch at the longest context)
    run.data["sections"] = sections
    if "decode" in sections:
        decode_section(run, models, contexts[:1], batches, steps, graph, shape["vocab"], dec_est)
    if "prefill" in sections:
        prefill_section(run, models, lengths[:1], shape["vocab"], pre_est)
    if "max_batch" in sections:
        max_batch_section(run, models, big, shape["vocab"], mem_cap, limit)
    if "decode" in sections:
        decode_section(run, models, contexts[1:], batches, steps, graph, shape["vocab"], dec_est)
    if "prefill" in sections:
        prefill_section(run, models, lengths[1:], shape["vocab"], pre_est)
    del models
    free(device)
    if "layer" in sections and run.fits(f"one layer T={layer_T}", 40.0 if gpu else 5.0):
        layer_section(run, shape, layer_T, dtype)
    run.say(f"done; skipped {run.data['skipped'] or 'nothing'}")
    run.save()
    return run.data


if __name__ == "__main__":
    main()
