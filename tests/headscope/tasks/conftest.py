"""Small tokenizers trained on the shipped haystack text (no downloads)."""
from __future__ import annotations

import random

import pytest


def _training_text() -> list[str]:
    from headscope.tasks import load_haystack

    rng = random.Random(0)
    numbers = " ".join(str(rng.randrange(0, 100_000)) for _ in range(5000))
    extra = "Compute: Let Then Who is older? Which country does live in? Answer: Question: The special magic number"
    return [load_haystack("heldout")[:200_000], numbers, extra]


def _wrap(tok, **special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


@pytest.fixture(scope="package")
def digit_tokenizer():
    """BPE with whitespace splitting, digits split one by one, and a BOS that it adds by default."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.train_from_iterator(_training_text(), trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>"],
                                                                 show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return _wrap(tok, bos_token="<s>", unk_token="<unk>")


@pytest.fixture(scope="package")
def bytelevel_tokenizer():
    """GPT-2-like byte-level BPE that merges digits (values need retries to match token counts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(_training_text(), trainer)
    return _wrap(tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="package")
def metaspace_tokenizer():
    """SentencePiece-like: "▁" word markers and single digits, so " 4321" starts with a lone "▁" token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.train_from_iterator(_training_text(), trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>"],
                                                                 show_progress=False))
    return _wrap(tok, unk_token="<unk>")


@pytest.fixture(scope="package", params=["digit", "bytelevel"])
def tokenizer(request, digit_tokenizer, bytelevel_tokenizer):
    return {"digit": digit_tokenizer, "bytelevel": bytelevel_tokenizer}[request.param]
