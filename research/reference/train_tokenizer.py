"""Train the reference model's byte-level BPE tokenizer (vocab ~4096, one token per digit).

    python research/reference/train_tokenizer.py                      # -> headscope/weights/default/
    python research/reference/train_tokenizer.py --out /tmp/tok --corpus data/corpus/train.txt

Trained on the training corpus plus a few thousand prompts of every task family (headscope.tasks,
generated with a text-only bootstrap tokenizer), so that prompt words ("magic", "number", ...) are
single tokens. Pre-tokenization is Qwen2's regex: every digit is its own piece, so " 4321" is
always a space token followed by four digit tokens and every 4-digit value has the same length.
Byte-level: any text encodes. The one special token <|endoftext|> is bos, eos and pad.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EOS = "<|endoftext|>"
# Qwen2's pre-tokenizer regex: \p{N} alone -> one piece per digit.
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TASK_FAMILIES = ("niah", "niah_multikey", "arithmetic", "binding", "comparison", "two_hop")


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 4096
    n_task_samples: int = 300  # prompts per task family added to the training text
    seed: int = 0

    def __post_init__(self) -> None:
        if not 512 <= self.vocab_size <= 65536:
            raise ValueError(f"TokenizerConfig.vocab_size must be in 512..65536, got {self.vocab_size}")
        if self.n_task_samples < 0:
            raise ValueError(f"TokenizerConfig.n_task_samples must be >= 0, got {self.n_task_samples}")


def build_bpe(texts, vocab_size: int):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on an iterable of strings."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_fast(tok):
    """A ``transformers.PreTrainedTokenizerFast`` around a trained ``tokenizers.Tokenizer``."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS,
                                   unk_token=None, model_max_length=1 << 20, clean_up_tokenization_spaces=False)
    fast.add_bos_token = False
    return fast


def task_prompts(tokenizer, n_per_task: int, seed: int) -> list[str]:
    """Clean prompts + answers of every task family (empty if headscope.tasks is not there yet)."""
    try:
        from headscope.tasks import get_task
    except ImportError:
        print("headscope.tasks not importable: tokenizer trained on the corpus only", file=sys.stderr)
        return []
    out = []
    for name in TASK_FAMILIES:
        cfg = {"context_length": 256, "haystack": "train"} if name.startswith("niah") else {}
        try:
            pairs = get_task(name, **cfg).generate(tokenizer, n_per_task, seed)
        except Exception as err:  # a family that fails must not block the tokenizer
            print(f"task {name!r} skipped for tokenizer samples: {err}", file=sys.stderr)
            continue
        out += [p.clean_prompt + p.clean_answer for p in pairs]
    return out


def chunks(text: str, size: int = 4000) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def train_tokenizer(corpus: Path, out: Path, cfg: TokenizerConfig):
    if not corpus.exists():
        raise FileNotFoundError(f"{corpus} missing: run `python research/prepare_corpus.py` first")
    text = corpus.read_text(encoding="utf-8")
    bootstrap = wrap_fast(build_bpe(chunks(text), cfg.vocab_size))
    prompts = task_prompts(bootstrap, cfg.n_task_samples, cfg.seed)
    random.Random(cfg.seed).shuffle(prompts)
    fast = wrap_fast(build_bpe(chunks(text) + prompts, cfg.vocab_size))
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    lens = {len(fast(f" {v:04d}")["input_ids"]) for v in range(1000, 10000, 7)}
    info = {"vocab_size": len(fast), "n_task_prompts": len(prompts), "corpus_chars": len(text),
            "four_digit_value_token_counts": sorted(lens)}
    print(json.dumps(info))
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=REPO / "data/corpus/train.txt")
    ap.add_argument("--out", type=Path, default=REPO / "headscope/weights/default")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--n-task-samples", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    train_tokenizer(a.corpus, a.out, TokenizerConfig(a.vocab_size, a.n_task_samples, a.seed))


if __name__ == "__main__":
    main()
