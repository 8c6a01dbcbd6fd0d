"""CPU benchmark: our exact fast receiver scores vs TransformerLens activation patching and our naive loop.

    python research/bench_receiver.py [--layers 6 --heads 8 --kv-heads 4 --hidden 256 --seq 192 ...]

A random-weight Qwen3 (sizes as flags), one NIAH-like pair of random tokens with the corrupted span in the
middle and a multi-token answer. TL's patching runs `corrupted_tokens` with `clean_cache` patched in, so for
the noising direction of the method (docs/method.md) we pass the clean tokens as its corrupted_tokens and the corrupted run's
cache as its clean_cache; both results are normalized as (M_clean - M_patched) / (M_clean - M_corrupt).
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch


def build(args):
    import transformers as tf

    torch.manual_seed(args.seed)
    cfg = tf.Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         intermediate_size=args.intermediate, max_position_embeddings=max(2048, args.seq),
                         initializer_range=0.1)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(args.seed)
    T, A = args.seq, args.answer
    clean = torch.randint(0, args.vocab, (T,), generator=g)  # [T]
    corrupt = clean.clone()
    p0 = int(T * args.depth)
    corrupt[p0:p0 + 4] = (corrupt[p0:p0 + 4] + 7) % args.vocab
    with torch.inference_mode():
        lc = model(clean[None]).logits[0, T - A:]  # [A, V]
        lx = model(corrupt[None]).logits[0, T - A:]  # [A, V]
    pair = SimpleNamespace(clean_ids=clean, corrupt_ids=corrupt, answer_pos=torch.arange(T - A, T),
                           clean_answer_ids=(lc - lx).argmax(-1), corrupt_answer_ids=(lx - lc).argmax(-1))
    return model, pair


def timed(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def tl_scores(model, pair, m_clean, m_corrupt):
    """TransformerLens get_act_patch_attn_head_out_all_pos on a TransformerBridge of the same model."""
    import transformers as tf
    from tokenizers import Tokenizer, models

    from headscope.patching.tl import bridge_from_hf
    from transformer_lens import patching

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(model.config.vocab_size)}, unk_token="t0"))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2")
    bridge = bridge_from_hf(model, fast)
    a = torch.arange(pair.answer_pos.shape[0])

    def metric(logits):  # logits  # [1, T, V]
        la = logits[0, pair.answer_pos]  # [A, V]
        return (la[a, pair.clean_answer_ids] - la[a, pair.corrupt_answer_ids]).mean()

    def run():
        with torch.inference_mode():
            _, corrupt_cache = bridge.run_with_cache(pair.corrupt_ids[None])
            patched = patching.get_act_patch_attn_head_out_all_pos(
                bridge, corrupted_tokens=pair.clean_ids[None], clean_cache=corrupt_cache, patching_metric=metric)
        return (m_clean - patched.double()) / (m_clean - m_corrupt)  # [L, H]
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [("layers", 6), ("heads", 8), ("kv-heads", 4), ("head-dim", 32), ("hidden", 256),
                          ("intermediate", 768), ("vocab", 4096), ("seq", 192), ("answer", 4), ("repeats", 2),
                          ("seed", 0), ("threads", 0)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--depth", type=float, default=0.5, help="first corrupted token as a fraction of --seq")
    ap.add_argument("--skip-naive", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from headscope.metrics import resolve_metric
    from headscope.patching import HFBackend, NaiveBackend, as_patch_pair

    model, raw = build(args)
    pair, metric = as_patch_pair(raw), resolve_metric("logit_diff")
    fast = HFBackend(model)
    with torch.inference_mode():
        m_clean = float(metric(fast.answer_logits(pair.clean_ids, pair.answer_pos), pair)[0])
        m_corrupt = float(metric(fast.answer_logits(pair.corrupt_ids, pair.answer_pos), pair)[0])
    norm = lambda m: (m_clean - m) / (m_clean - m_corrupt)  # noqa: E731
    n_heads = args.layers * args.heads
    print(f"model: Qwen3 random weights, {args.layers} layers x {args.heads} heads ({args.kv_heads} kv), hidden "
          f"{args.hidden}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; seq {args.seq}, first "
          f"diff {pair.first_diff}, {args.answer}-token answer; torch threads {torch.get_num_threads()}")
    print(f"M_clean {m_clean:.4f}  M_corrupt {m_corrupt:.4f}")
    ours, t_ours = timed(lambda: norm(fast.patched_metrics(pair, metric)), args.repeats)
    print(f"ours (hf fast path): {t_ours:.3f} s for {n_heads} heads ({1e3 * t_ours / n_heads:.2f} ms/head)")
    if not args.skip_naive:
        naive, t_naive = timed(lambda: norm(NaiveBackend(model).patched_metrics(pair, metric)), 1)
        print(f"ours (naive loop):   {t_naive:.3f} s   | max |S_fast - S_naive| = {(ours - naive).abs().max():.2e}"
              f"   speed-up {t_naive / t_ours:.1f}x")
    try:
        run_tl = tl_scores(model, pair, m_clean, m_corrupt)
    except ImportError as err:
        print(f"TransformerLens not available ({err}); skipped")
        return
    tl, t_tl = timed(run_tl, args.repeats)
    print(f"TransformerLens get_act_patch_attn_head_out_all_pos (bridge): {t_tl:.3f} s   | max |S_ours - S_TL| = "
          f"{(ours - tl).abs().max():.2e} (target <= 1e-4)   speed-up {t_tl / t_ours:.1f}x (target >= 4x)")


if __name__ == "__main__":
    main()
