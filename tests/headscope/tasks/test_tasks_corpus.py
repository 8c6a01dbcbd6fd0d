"""experiments/prepare_corpus.py helpers and the shipped haystack."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def pc():
    spec = importlib.util.spec_from_file_location("prepare_corpus", ROOT / "experiments" / "prepare_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_clean_text_strips_boilerplate(pc):
    raw = ("The Project Gutenberg EBook of Hamlet\r\n*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n"
           "<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS IS COPYRIGHT 1990-1993\nBY WORLD LIBRARY, INC.>>\n"
           "ACT I.\n\n\n\n  Who's   there?\tNay, answer me.\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nlicence")
    text = pc.clean_text(raw)
    assert text == "ACT I.\n\nWho's there? Nay, answer me.\n"


def test_split_is_by_work_and_deterministic(pc):
    names = [f"work_{i}" for i in range(40)]
    train, heldout = pc.split_works(names)
    assert len(heldout) == 4 and not set(train) & set(heldout) and set(train) | set(heldout) == set(names)
    assert pc.split_works(list(reversed(names))) == (train, heldout)


def test_trim_to_bytes_cuts_at_paragraph(pc):
    text = "\n\n".join(f"Paragraph {i} " + "word " * 20 for i in range(100))
    cut = pc.trim_to_bytes(text, 1000)
    assert len(cut.encode()) <= 1000 and text.startswith(cut.rstrip()) and cut.rstrip().endswith("word")


def test_shipped_haystack():
    path = ROOT / "headscope" / "tasks" / "data" / "haystack_heldout.txt"
    text = path.read_text(encoding="utf-8")
    assert 100_000 < len(text.encode()) <= 1_500_000
    assert "Gutenberg" not in text and "\r" not in text and "\n\n\n" not in text
    heldout = ROOT / "data" / "corpus" / "heldout.txt"
    if heldout.exists():
        assert heldout.read_text(encoding="utf-8").startswith(text.rstrip())
