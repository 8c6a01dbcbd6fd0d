"""Haystack text for needle-in-a-haystack tasks: loading, sentence boundaries, needle insertion.

Sources: "heldout" (shipped with the package: held-out Shakespeare works, never in the training corpus),
"train" (data/corpus/train.txt, built by research/prepare_corpus.py), a UTF-8 file path, or the text itself
(long or multi-line; a short single-line string that looks like a path must name an existing file).
"""
from __future__ import annotations

import bisect
import functools
import os
import re
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "data" / "haystack_heldout.txt"
REPO_ROOT = Path(__file__).resolve().parents[2]
CORPUS = REPO_ROOT / "data" / "corpus"

_SENTENCE_END_RE = re.compile(r"[.!?][\"')\]]*(?=\s)")
_PARAGRAPH_RE = re.compile(r"\n\s*\n")


@functools.lru_cache(maxsize=8)
def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"haystack file {path} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}, "
                         f"{e.reason}); convert it to UTF-8 first, e.g. iconv -f latin1 -t utf-8 {path} > "
                         f"{Path(path).stem}.utf8.txt (or re-save it as UTF-8 in an editor)") from None


def _looks_like_path(source: str) -> bool:
    """A single-line string that names a file rather than being text: it ends in a text-file suffix, or
    holds a path separator and is either short (< 200 characters: too short to be a haystack) or has no
    whitespace (a line of prose with a slash in it stays text)."""
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if source.rstrip().lower().endswith((".txt", ".md", ".text")):
        return True
    return any(c in source for c in seps) and (len(source) < 200 or not any(c.isspace() for c in source))


def load_haystack(source: str | os.PathLike = "heldout") -> str:
    """Haystack text: "heldout", "train", a path to a UTF-8 text file (a ``str`` or ``os.PathLike``), or
    (long, multi-line) text itself.

    A single-line string under 1000 characters that looks like a path (holds ``/`` or ends in ``.txt``)
    must name an existing file: a missing one is refused naming the path (it is not used as the text).
    A file that is not UTF-8 is refused naming the file, with the fix (convert it to UTF-8).
    """
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
        if not isinstance(source, str) or not source:
            raise ValueError(f"haystack={source!r}: give 'heldout', 'train', a text file path, or the text itself")
        return _read_file(Path(source))
    if not isinstance(source, str) or not source:
        raise ValueError(f"haystack={source!r}: give 'heldout', 'train', a text file path, or the text itself")
    if source == "heldout":
        if not SHIPPED.exists():
            raise FileNotFoundError(f"shipped haystack {SHIPPED} is missing; run python research/prepare_corpus.py")
        return _read(str(SHIPPED))
    if source == "train":
        path = CORPUS / "train.txt"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing; build it with python research/prepare_corpus.py")
        return _read(str(path))
    if "\n" not in source and len(source) < 1000:
        path = Path(source).expanduser()
        if path.exists() or _looks_like_path(source):
            return _read_file(path, shown=source)
        if len(source) < 200:
            raise ValueError(f"haystack={source!r} is not 'heldout', 'train' or an existing file; "
                             "pass a path to a text file, or the haystack text itself (at least 200 characters)")
    return source


def _read_file(path: Path, shown: str | None = None) -> str:
    shown = str(path) if shown is None else shown
    if not path.exists():
        raise ValueError(f"haystack={shown!r}: no such file ({path.resolve()}); check the path, or give "
                         "'heldout' or 'train' (a path-like string is not used as the haystack text itself)")
    if not path.is_file():
        raise ValueError(f"haystack={shown!r}: {path.resolve()} is not a regular file; give a UTF-8 text file, "
                         "'heldout' or 'train'")
    return _read(str(path.resolve()))


@functools.lru_cache(maxsize=8)
def paragraph_starts(text: str) -> tuple[int, ...]:
    """Character offsets where paragraphs start (0 and after each blank line)."""
    return (0,) + tuple(m.end() for m in _PARAGRAPH_RE.finditer(text))


def chunk(text: str, start: int, n_chars: int) -> str:
    """n_chars of text from start, wrapping around to the beginning (separated by a blank line) if needed."""
    out = text[start: start + n_chars]
    while len(out) < n_chars:
        out += "\n\n" + text[: n_chars - len(out) - 2]
    return out


def sentence_boundaries(text: str) -> list[int]:
    """Offsets where a needle may go: 0, right after each sentence end (. ! ? before whitespace), len(text)."""
    return sorted({0, len(text), *(m.end() for m in _SENTENCE_END_RE.finditer(text))})


def line_ends(text: str) -> list[int]:
    """Offsets of the ends of non-empty lines (just before a newline): fallback places for a needle."""
    return sorted({0, len(text), *(m.start() for m in re.finditer(r"(?<=\S)\n", text))})


def needle_place(text: str, depth: float, slack: float = 0.02) -> int:
    """Where a needle at depth goes: the nearest sentence end, or the nearest line end if no sentence
    ends within slack * len(text) of depth * len(text) (verse has long sentences)."""
    target = depth * len(text)
    place = nearest_boundary(sentence_boundaries(text), target)
    if abs(place - target) > slack * len(text):
        place = nearest_boundary(line_ends(text), target)
    return place


def nearest_boundary(boundaries: list[int], target: float) -> int:
    """The boundary closest to character position target."""
    i = bisect.bisect_left(boundaries, target)
    cands = boundaries[max(0, i - 1): i + 1]
    return min(cands, key=lambda b: (abs(b - target), b))


def insert_needles(text: str, needles: list[tuple[float, str]]) -> tuple[str, list[int]]:
    """Insert each (depth in [0, 1], sentence) at the sentence boundary (or line end) nearest depth * len(text).

    Returns the new text and the character offset of each needle in it (same order as given).
    A needle at a boundary is joined with one space; at the very start it is followed by a space.
    """
    places = [needle_place(text, d) for d, _ in needles]
    order = sorted(range(len(needles)), key=lambda i: (places[i], i))
    pieces, starts, prev, pos = [], [0] * len(needles), 0, 0
    for i in order:
        piece = text[prev: places[i]]
        pieces.append(piece)
        pos += len(piece)
        sep_before = " " if places[i] > 0 else ""
        needle = needles[i][1]
        sep_after = " " if places[i] == 0 else ""
        pieces.append(sep_before + needle + sep_after)
        starts[i] = pos + len(sep_before)
        pos += len(sep_before) + len(needle) + len(sep_after)
        prev = places[i]
    pieces.append(text[prev:])
    return "".join(pieces), starts


def tokenize_text(tokenizer, text: str, chunk_chars: int = 100_000):
    """The whole text as one long id tensor ``[N]`` (tokenized in chunks cut at blank lines, no special tokens)."""
    import torch

    ids: list[int] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + chunk_chars)
        cut = text.rfind("\n\n", start, end) if end < len(text) else end
        end = cut + 2 if cut > start else end
        ids += tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
        start = end
    return torch.tensor(ids, dtype=torch.long)
