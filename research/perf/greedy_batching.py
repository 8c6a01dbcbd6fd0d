"""Greedy continuations of a hybrid in the fidelity evaluation, two ways side by side in one run: rows of any
lengths batched on the hybrid's static cache (``HybridForCausalLM.greedy_decode``, what
``headscope.evaluate.fidelity_decoding.greedy_continuations`` takes) against equal-length batches stepped one
token at a time (what it did before, and what a model with neither padding nor ``greedy_decode`` gets).

    python -m research.perf.greedy_batching                                  # CPU: the reference model, 7:1 mask
    python -m research.perf.greedy_batching --device cuda --model smollm2-135m --prompts 64 --new 128

Prompts: --prompts random token-id prompts of --min-len to --max-len tokens (seeded), --new greedy tokens each,
no stop token. Prints both times (the median of --repeats after one untimed call), their ratio, and whether the
two ways gave the same tokens. A benchmark, not a test: run it where the numbers are wanted.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _time(fn, device: str, repeats: int) -> tuple[float, list]:
    out = fn()  # untimed: allocation, graph capture, autotuning
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="headscope.load_model name (its shipped mask is converted)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=60)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64, help="rows per batch at most (EvalContext.batch_size)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not 1 <= a.min_len <= a.max_len:
        ap.error(f"--min-len {a.min_len} and --max-len {a.max_len}: give 1 <= min <= max")

    from headscope.evaluate import fidelity_decoding as fd
    from headscope.evaluate.runtime import EvalContext
    from research.perf.generate_speed import build

    _, model, what = build(a.model, None, a.device, torch.float32)
    g = torch.Generator().manual_seed(a.seed)
    lengths = torch.randint(a.min_len, a.max_len + 1, (a.prompts,), generator=g).tolist()
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    ctx = EvalContext(progress=False, batch_size=a.batch, token_budget=1 << 30)

    def own_rows():
        return fd.greedy_continuations(model, prompts, a.new, ctx, pad_id=0)

    def equal_length():
        return fd._greedy_stepwise(model, prompts, a.new, ctx, pad_id=0)

    t_own, out_own = _time(own_rows, a.device, a.repeats)
    t_eq, out_eq = _time(equal_length, a.device, a.repeats)
    res = {"model": a.model, "mask": what, "device": a.device, "prompts": a.prompts, "lengths": [a.min_len, a.max_len],
           "new": a.new, "own_rows_s": round(t_own, 4), "equal_length_s": round(t_eq, 4),
           "ratio": round(t_eq / t_own, 2), "same_tokens": out_own == out_eq}
    print(res, flush=True)
    return res


if __name__ == "__main__":
    main()
