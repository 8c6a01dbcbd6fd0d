"""Tokens per second of one data worker (hybrid/train/data.py) for a training mixture, with the
task's exact-length NIAH prompts and with ``fast_niah`` (prompts around corpus token windows), side by side.

    python research/reference/bench_data.py                 # stage-3 mixture, 6 batches of 65,536 tokens each way

The H200 runs use 13 such workers; stages 2-3 trained at 0.5-1.0 M tokens/s, bound by them.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from hybrid.train.data import MixtureConfig, MixtureStream
from hybrid.train.text import tokenize_corpus

REPO = Path(__file__).resolve().parents[2]
STAGE3 = dict(seq_len=2048, tokens_per_batch=65536, haystack_weight=0.1, multikey_min_len=128, extra_queries=3,
              w_text=0.1, w_niah=0.15, w_multikey=0.35, w_reasoning=0.35, w_copy=0.05,
              reasoning_families=("arithmetic", "comparison", "binding", "binding", "binding", "two_hop", "two_hop"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--corpus", type=Path, default=REPO / "data/corpus/train.txt")
    ap.add_argument("--tokenizer", type=Path, default=REPO / "headscope/weights/default")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    if not a.corpus.exists():
        raise FileNotFoundError(f"{a.corpus} missing: run python research/prepare_corpus.py")
    ids = tokenize_corpus(tok, a.corpus.read_text(encoding="utf-8"))  # [N]
    rates = {}
    for fast in (False, True):
        stream = MixtureStream(MixtureConfig(fast_niah=fast, **STAGE3), tok, ids)
        stream.batch(0, 1.0)  # warm-up: task objects, haystack caches
        t0, n = time.perf_counter(), 0
        for step in range(1, a.batches + 1):
            n += stream.batch(step, 1.0)["ids"].numel()
        rates[fast] = n / (time.perf_counter() - t0)
        print(f"{'fast_niah' if fast else 'exact NIAH':>10}: {rates[fast]:,.0f} tokens/s per worker", flush=True)
    print(f"fast / exact: {rates[True] / rates[False]:.2f}x")


if __name__ == "__main__":
    main()
