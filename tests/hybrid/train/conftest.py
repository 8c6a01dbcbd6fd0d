"""Fixtures for hybrid.train: the reference tokenizer, a tiny Qwen3 teacher saved to disk with it, a mask."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ref_tokenizer():
    from transformers import AutoTokenizer

    from headscope.reference import default_path

    return AutoTokenizer.from_pretrained(default_path(), local_files_only=True)


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory, ref_tokenizer):
    """A 2-layer Qwen3 (4 heads, 2 KV heads, vocab of the reference tokenizer) saved with the tokenizer."""
    from train_factories import save_tiny_teacher

    return save_tiny_teacher(tmp_path_factory.mktemp("teacher"), ref_tokenizer)


@pytest.fixture(scope="session")
def tiny_mask(tiny_teacher_dir, tmp_path_factory):
    from train_factories import save_mask

    return save_mask(tiny_teacher_dir, tmp_path_factory.mktemp("mask") / "mask.json")
