"""Tokenizer discovery: score(model, task) without tokenizer= for the shipped model and a local HF folder."""
from __future__ import annotations

import pytest
import torch

import headscope
from headscope.pairs import task_pairs
from headscope.reference import default_path, has_default_weights
from headscope.tokenizers import TokenizerNotFound, find_tokenizer

from char_tokenizer import char_tokenizer, word_tokenizer
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

SHIPPED = pytest.mark.skipif(not has_default_weights(), reason="headscope/weights/default holds no weights")
NIAH = dict(context_length=160)


@pytest.fixture
def folder(tmp_path):
    """A tiny model and its (one token per character) tokenizer saved as a Hugging Face folder."""
    tiny_model("qwen3", initializer_range=0.2).save_pretrained(tmp_path / "tiny")
    char_tokenizer().save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


@SHIPPED
def test_shipped_model_scores_without_tokenizer():
    """The mission's call: load_model("default") then score(model, task="niah"), no tokenizer= anywhere."""
    model, tok = headscope.load_model("default")
    assert find_tokenizer(model) is tok  # remembered by load_model, not reloaded
    s = headscope.score(model, task="niah", n_samples=1, progress=False, context_length=256)
    ref = headscope.score(model, task="niah", tokenizer=tok, n_samples=1, progress=False, context_length=256)
    assert s.task == "niah" and torch.equal(s.per_sample_raw, ref.per_sample_raw)


@SHIPPED
def test_shipped_folder_loaded_by_transformers_finds_its_tokenizer():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_path())
    tok = find_tokenizer(model)
    assert tok.name_or_path == str(default_path()) and tok.pad_token_id is not None
    assert find_tokenizer(model) is tok  # cached per model


def test_local_folder_model_scores_without_tokenizer(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    found = find_tokenizer(model)
    assert found("abc").input_ids == char_tokenizer()("abc").input_ids
    s = headscope.score(model, "niah", n_samples=1, progress=False, min_clean_accuracy=0.0, **NIAH)
    ref = headscope.score(model, "niah", tokenizer=char_tokenizer(), n_samples=1, progress=False,
                          min_clean_accuracy=0.0, **NIAH)
    assert torch.equal(s.per_sample_raw, ref.per_sample_raw)
    loaded, tok = headscope.load_model(folder)  # through headscope too
    assert find_tokenizer(loaded) is tok


def test_explicit_tokenizer_wins(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    other = word_tokenizer()
    assert find_tokenizer(model, other) is other
    pairs = task_pairs(model, "niah", tokenizer=char_tokenizer(), n_samples=1, **NIAH)
    assert len(pairs) == 1


def test_no_tokenizer_found_says_what_to_pass(tmp_path):
    model = tiny_model("qwen3")  # built in memory: names no folder
    with pytest.raises(TokenizerNotFound, match=r"tokenizer=.*load_model"):
        headscope.score(model, "niah", n_samples=1, progress=False, **NIAH)
    tiny_model("qwen3").save_pretrained(tmp_path / "no_tok")  # a folder without a tokenizer
    from transformers import AutoModelForCausalLM

    bare = AutoModelForCausalLM.from_pretrained(tmp_path / "no_tok")
    with pytest.raises(TokenizerNotFound, match=r"holds no tokenizer.*tokenizer=AutoTokenizer"):
        find_tokenizer(bare)
    assert find_tokenizer(bare, required=False) is None
    bare.name_or_path = bare.config._name_or_path = str(tmp_path / "gone")  # not there, nor a cached hub name
    with pytest.raises(TokenizerNotFound, match="offline"):
        find_tokenizer(bare)


def test_task_pairs_bad_inputs():
    model, tok = tiny_model("qwen3"), char_tokenizer()
    with pytest.raises(ValueError, match="n_samples"):
        task_pairs(model, "niah", tokenizer=tok, n_samples=0)
    with pytest.raises(ValueError, match="give a model"):
        task_pairs(None, "niah")
    with pytest.raises(TypeError, match="task must be a name"):
        task_pairs(model, 42, tokenizer=tok)
    with pytest.raises(ValueError, match="only apply to a task given by name"):
        from headscope.tasks import get_task

        task_pairs(model, get_task("niah"), tokenizer=tok, context_length=64)
    pairs = task_pairs(None, "niah", tokenizer=tok, n_samples=2, seed=3, **NIAH)  # no model: tokenizer given
    assert task_pairs(model, pairs) == pairs and len(pairs) == 2
