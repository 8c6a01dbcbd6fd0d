"""GPU benchmark (one H200): exact fast receiver scores of all 448 heads of a Qwen3-1.7B-shaped model.

    python research/bench_receiver_gpu.py            # writes $OUT/bench_receiver_gpu.json if $OUT is set

Random weights shaped like Qwen3-1.7B (28 layers, 16 query / 8 kv heads, head_dim 128, hidden 2048,
intermediate 6144, vocab 151936), bf16, sdpa; one 4096-token NIAH-like pair of random tokens with the
corrupted span at 2048 and a 4-token answer. Prints: ours (all heads, timed), a naive loop of one SDPA
forward per head and TransformerLens-bridge per-head patching (each on a SUBSET of heads, extrapolated to
448 and labeled so), achieved TFLOP/s of our method vs 790 TFLOP/s, peak memory, and fast-vs-naive
agreement on the subset in bf16. Only torch + transformers are needed; TransformerLens is optional.

    python research/bench_receiver_gpu.py --model smollm2-135m --contexts 2048,8192   # a real registry model

With --model: the model from headscope.load_model (bf16, sdpa) and real NIAH pairs of its tokenizer at each
context; times our exact scores of ALL heads per pair (HFBackend) and TransformerLens per-head patching on
the same pair (a subset of heads, extrapolated and labeled so). On the GPU machine the registry reads the
GGUF staged by python -m research.stage (docs/research.md). --device cpu --contexts 256 is a smoke test.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

PEAK_TFLOPS = 790.0  # H200 dense bf16
DEV = "cuda"  # --device cpu: a smoke test of this script with small --layers/--hidden/... flags


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def build(args):
    from headscope.synthetic import moved_answer_pair, random_qwen3

    shape = dict(layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                 hidden=args.hidden, intermediate=args.intermediate, vocab=args.vocab)
    model = random_qwen3(shape, device=DEV, dtype=torch.bfloat16, seed=args.seed,
                         max_position_embeddings=max(40960, args.seq))
    pair = moved_answer_pair(model, args.seq, args.first_diff, args.answer, torch.Generator().manual_seed(args.seed))
    return model, pair


def our_flops(args, p0: int, T: int) -> float:
    """Matmul + causal attention FLOPs of the fast path: per start layer l, layer l from o_proj on, layers > l
    in full, on the suffix of `batch` rows; lm_head on the answer rows; plus the clean and corrupted runs."""
    C, I, H, K, D, L, V, A = (args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim, args.layers,
                              args.vocab, args.answer)
    S = T - p0
    keys = sum(p + 1 for p in range(p0, T))  # causal (query, key) pairs of the suffix
    o_mlp = 2 * S * (H * D * C + 3 * C * I)
    full = 2 * S * C * (H * D + 2 * K * D) + 4 * H * D * keys + o_mlp
    # one row per head: H rows start at each layer l (layer l from o_proj on, then L-1-l full layers)
    rows_all_layers = sum(o_mlp + (L - 1 - l) * full for l in range(L)) + L * 2 * A * C * V
    keys_all = T * (T + 1) // 2
    full_run = L * (2 * T * C * (2 * H * D + 2 * K * D) + 6 * T * C * I + 4 * H * D * keys_all)
    return H * rows_all_layers + 2 * full_run


def naive_subset(model, pair, heads, metric):
    """One full SDPA forward per head (the reference loop), only for `heads`."""
    from headscope.arch import describe
    from headscope.hooks import record_inputs
    from headscope.patching.engine import patch_heads

    arch = describe(model)
    ids_c, ids_x = pair.clean_ids[None].to(DEV), pair.corrupt_ids[None].to(DEV)
    pos = pair.answer_pos.to(DEV)
    out = {}
    with torch.inference_mode():
        with record_inputs(arch.out_projs) as z_corrupt:
            model(ids_x, use_cache=False, logits_to_keep=1)
        sync()
        t = time.perf_counter()
        for l, h in heads:
            with patch_heads(arch.out_projs, arch, [(l, h)], z_corrupt):
                logits = model(ids_c, use_cache=False).logits[:, pos]  # [1, A, V]
            out[(l, h)] = float(metric(logits.float(), pair)[0])
        sync()
    return out, (time.perf_counter() - t) / len(heads)


def tl_subset(model, pair, heads, metric):
    """TransformerLens bridge, one forward per head patching blocks.{l}.attn.hook_z (TL patching style)."""
    import transformers as tf
    from tokenizers import Tokenizer, models

    from headscope.patching.tl import bridge_from_hf

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(model.config.vocab_size)}, unk_token="t0"))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2")
    bridge = bridge_from_hf(model, fast)
    with torch.inference_mode():
        _, cache = bridge.run_with_cache(pair.corrupt_ids[None].to(DEV), names_filter=lambda n: n.endswith("hook_z"))
        sync()
        t = time.perf_counter()
        for l, h in heads:
            def hook(z, hook, l=l, h=h):
                z[:, :, h] = cache[f"blocks.{l}.attn.hook_z"][:, :, h]
                return z
            logits = bridge.run_with_hooks(pair.clean_ids[None].to(DEV), fwd_hooks=[(f"blocks.{l}.attn.hook_z", hook)])
            metric(logits[:, pair.answer_pos.to(DEV)].float(), pair)
        sync()
    return (time.perf_counter() - t) / len(heads)


def real_model_bench(args):
    """Exact receiver scores of every head of a registry model on NIAH pairs at each context, vs TransformerLens."""
    import headscope
    from headscope.metrics import resolve_metric
    from headscope.patching import HFBackend, HFFastConfig, as_patch_pair
    from headscope.tasks import get_task
    from headscope.zoo import task_defaults

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    t = time.perf_counter()
    model, tok = headscope.load_model(args.model, dtype=dtype, device=DEV)
    arch = headscope.describe(model)
    n_heads = arch.n_layers * arch.n_heads
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "torch": torch.__version__,
           "model": args.model, "dtype": str(dtype), "n_heads": n_heads, "load_s": time.perf_counter() - t,
           "contexts": {}}
    print(f"model {args.model}: {arch.n_layers} x {arch.n_heads} = {n_heads} heads, {dtype} on {res['device']}; "
          f"loaded in {res['load_s']:.1f} s")
    metric = resolve_metric("logit_diff")
    backend = HFBackend(model, HFFastConfig(batch_size=args.batch_size))
    for ctx in args.contexts:
        cfg = {**task_defaults(args.model, "niah"), "context_length": ctx, "depth": "uniform"}
        raws = get_task("niah", **cfg).tokenized(tok, n=args.n_pairs, seed=0)
        times = []
        for raw in raws:
            pair = as_patch_pair(raw)
            for rep in range(args.repeats):  # the first of the first pair includes CUDA warm-up
                sync()
                t = time.perf_counter()
                backend.patched_metrics(pair, metric)  # [L, H]
                sync()
                times.append(time.perf_counter() - t)
        ours = sorted(times)[len(times) // 2]
        row = {"n_pairs": len(raws), "seq_len": [p.seq_len for p in raws], "ours_s_per_pair_median": ours,
               "ours_all_s": times, "ours_ms_per_head": 1e3 * ours / n_heads}
        if DEV == "cuda":
            row["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"  {ctx:>5} tokens: ours (all {n_heads} heads) {ours:.2f} s per pair (median of {len(times)}; "
              f"{row['ours_ms_per_head']:.1f} ms/head)")
        try:
            import transformer_lens  # noqa: F401
        except ImportError:
            print("         TransformerLens not installed here: skipped")
        else:
            pair = as_patch_pair(raws[0])
            subset = [(l, h) for l in sorted({0, arch.n_layers // 2, arch.n_layers - 1}) for h in range(arch.n_heads)]
            subset = subset[:args.tl_heads]
            try:
                t_tl = tl_subset(model, pair, subset, metric)
            except Exception as err:  # a TL API change must not cost the other contexts on the GPU
                row["tl_error"] = f"{type(err).__name__}: {err}"
                print(f"         TransformerLens failed: {row['tl_error']}")
                res["contexts"][str(ctx)] = row
                write_real(args, res)
                continue
            row.update(tl_ms_per_head_subset=1e3 * t_tl, tl_heads_timed=len(subset),
                       tl_s_extrapolated_all_heads=t_tl * n_heads, speedup_vs_tl=t_tl * n_heads / ours)
            print(f"         TransformerLens (one forward per head): {1e3 * t_tl:.1f} ms/head on {len(subset)} heads, "
                  f"EXTRAPOLATED to {n_heads}: {t_tl * n_heads:.1f} s -> ours {t_tl * n_heads / ours:.1f}x faster")
        res["contexts"][str(ctx)] = row
        write_real(args, res)  # after every context: a run cut short keeps the contexts done
    return res


def write_real(args, res) -> None:
    """$OUT/bench_receiver_gpu_<model>.json (or --json), when either is set."""
    from headscope.io import write_text

    out = os.environ.get("OUT")
    name = "".join(c if c.isalnum() else "_" for c in os.path.basename(args.model.rstrip("/")))
    path = args.json or (os.path.join(out, f"bench_receiver_gpu_{name}.json") if out else None)
    if path:
        write_text(path, json.dumps(res, indent=2))
        print(f"wrote {path}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [("layers", 28), ("heads", 16), ("kv-heads", 8), ("head-dim", 128), ("hidden", 2048),
                          ("intermediate", 6144), ("vocab", 151936), ("seq", 4096), ("first-diff", 2048),
                          ("answer", 4), ("repeats", 2), ("naive-heads", 12), ("tl-heads", 6), ("seed", 0)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="a registry model / folder: real NIAH pairs instead of random weights")
    ap.add_argument("--contexts", default="2048,8192", help="with --model: NIAH lengths in tokens")
    ap.add_argument("--n-pairs", type=int, default=2, help="with --model: NIAH pairs per context")
    ap.add_argument("--json", default=None, help="with --model: the JSON file (default $OUT/bench_receiver_gpu_<model>.json)")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    if args.model:
        args.contexts = [int(c) for c in args.contexts.split(",") if c]
        return real_model_bench(args)
    from headscope.metrics import resolve_metric
    from headscope.patching import HFBackend, HFFastConfig, as_patch_pair

    model, raw = build(args)
    pair, metric = as_patch_pair(raw), resolve_metric("logit_diff")
    n_heads = args.layers * args.heads
    backend = HFBackend(model, HFFastConfig(batch_size=args.batch_size))
    with torch.inference_mode():
        m_clean = float(metric(backend.answer_logits(pair.clean_ids, pair.answer_pos), pair)[0])
        m_corrupt = float(metric(backend.answer_logits(pair.corrupt_ids, pair.answer_pos), pair)[0])
    norm = lambda m: (m_clean - m) / (m_clean - m_corrupt)  # noqa: E731
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):  # the first includes CUDA warm-up
        sync()
        t = time.perf_counter()
        ours = norm(backend.patched_metrics(pair, metric))  # [L, H]
        sync()
        times.append(time.perf_counter() - t)
    t_ours = min(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else float("nan")
    flops = our_flops(args, pair.first_diff, pair.seq_len)
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "torch": torch.__version__, "seq": pair.seq_len,
           "first_diff": pair.first_diff, "answer_tokens": args.answer, "n_heads": n_heads,
           "m_clean": m_clean, "m_corrupt": m_corrupt, "ours_s_per_sample": t_ours, "ours_all_runs_s": times,
           "ours_ms_per_head": 1e3 * t_ours / n_heads, "ours_tflops": flops / t_ours / 1e12,
           "ours_tflop_count": flops / 1e12, "peak_tflops": PEAK_TFLOPS, "max_memory_allocated_gib": peak}
    print(f"model: Qwen3-1.7B-shaped random weights, bf16 sdpa, {n_heads} heads; seq {pair.seq_len}, first diff "
          f"{pair.first_diff}, {args.answer}-token answer; M_clean {m_clean:.3f} M_corrupt {m_corrupt:.3f}")
    print(f"ours (hf fast path, all {n_heads} heads): {t_ours:.2f} s/sample ({res['ours_ms_per_head']:.1f} ms/head; "
          f"runs {['%.2f' % x for x in times]}); {flops / 1e12:.0f} TFLOP counted -> {res['ours_tflops']:.0f} TFLOP/s "
          f"({100 * res['ours_tflops'] / PEAK_TFLOPS:.0f}% of {PEAK_TFLOPS:.0f}); max_memory_allocated {peak:.1f} GiB")

    L, H = args.layers, args.heads
    subset = [(l, h) for l in sorted({0, L // 2, L - 1}) for h in range(0, H, max(1, H // (args.naive_heads // 3 or 1)))]
    subset = subset[:args.naive_heads]
    naive, t_naive = naive_subset(model, pair, subset, metric)
    diffs = [abs(float(ours[l, h]) - float(norm(torch.tensor(naive[(l, h)])))) for l, h in subset]
    res.update(naive_ms_per_head_subset=1e3 * t_naive, naive_heads_timed=len(subset),
               naive_s_extrapolated_448=t_naive * n_heads, fast_vs_naive_max_abs_bf16=max(diffs),
               speedup_vs_naive=t_naive * n_heads / t_ours)
    print(f"naive loop (one SDPA forward per head): {1e3 * t_naive:.1f} ms/head, timed on {len(subset)} heads, "
          f"EXTRAPOLATED to {n_heads}: {t_naive * n_heads:.1f} s -> ours {t_naive * n_heads / t_ours:.1f}x faster")
    print(f"fast vs naive on those {len(subset)} heads (bf16): max |S_fast - S_naive| = {max(diffs):.3e}; "
          f"score range {float(ours.min()):.3f}..{float(ours.max()):.3f}")
    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        print("TransformerLens not installed here: skipped (reference measured once on this H200: 153 ms/head -> "
              f"{0.153 * n_heads:.1f} s for {n_heads} heads; ours {0.153 * n_heads / t_ours:.1f}x faster)")
        res["tl_ms_per_head_reference"] = 153.0
        res["speedup_vs_tl_reference"] = 0.153 * n_heads / t_ours
    else:
        t_tl = tl_subset(model, pair, subset[:args.tl_heads], metric)
        res.update(tl_ms_per_head_subset=1e3 * t_tl, tl_s_extrapolated_448=t_tl * n_heads,
                   speedup_vs_tl=t_tl * n_heads / t_ours)
        print(f"TransformerLens bridge (one forward per head): {1e3 * t_tl:.1f} ms/head on {args.tl_heads} heads, "
              f"EXTRAPOLATED to {n_heads}: {t_tl * n_heads:.1f} s -> ours {t_tl * n_heads / t_ours:.1f}x faster "
              "(target >= 10x)")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_receiver_gpu.json"), "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {os.path.join(out, 'bench_receiver_gpu.json')}")


if __name__ == "__main__":
    main()
