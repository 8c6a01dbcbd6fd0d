"""What a GPU machine sends back for the next machines while its job still runs, and where it goes here.

A lease can end before its job does (the lease's time runs out, or the machine is taken back), and what the job
made for later machines is then lost with it unless it came back earlier. ``harvest`` runs after each of the job's
commands (``research.stage carry JOB --plan`` puts it there, after ``pack``) and writes into ``$OUT``, beside what
is already there and within what a command returns (8 files, 64 MiB):

- the teacher's text the job made (``teacher_text.tar.xz``: ``teacher/teacher.txt`` and ``teacher.json`` of the
  job's copy of the checkout, once ``teacher.json`` exists, which self_distill writes last), ~150 s of a cold
  machine's time;
- the compile cache (``compile_cache.tgz.partKofN``, ``research.stage_caches.compile_cache_save``), each time it
  grew since the last harvest: the first compiled step of each stage took 35-133 s on a cold H100.

What it wrote is recorded in ``RUNS/JOB.harvest.json``, so a later command sends only what changed. A teacher's
text that came carried (``setup`` extracted it from the corpus's parts and left its signature in
``/tmp/stage/teacher_text.carried``) is not sent back: the checkout here has it.

``stow`` puts such files, as they come back, where the next lease reads them: the teacher's text into
``data/corpus/teacher/`` and the corpus's parts made again with it (``split-corpus``: the launcher then skips
making it), a whole set of compile-cache parts into ``.stage/`` (replacing an older set), a results folder's parts
(``pack``) unpacked into ``runs/``.

    python3 -m research.stage harvest JOB "$OUT"           # on the GPU machine, after detached.sh and pack
    python -m research.stage stow /work/.device/N/*        # here
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

from research.stage_caches import (COMPILE_RE, cache_files, compile_cache_save, extract_file, inductor_dir, say,
                                   triton_dir)

RUNS = Path("/tmp/runs")
OUT_FILES, OUT_BYTES = 8, 64 * 2**20  # what one command may return
TEXT_ARCHIVE = "teacher_text.tar.xz"
TEACHER_DIR = "teacher"  # beside the manifest: the broad recipe's [data] teacher_corpus (research.corpus.self_distill)
TEACHER_FILES = ("teacher.txt", "teacher.json")  # what travels of it (not its parts/)
TEXT_FILES = tuple(f"{TEACHER_DIR}/{name}" for name in TEACHER_FILES)  # below the corpus folder
PACK_RE = re.compile(r"^(?P<name>.+)\.tgz\.part\d+$")


def _digest(entries) -> str:
    """16 hex digits of (name, size) pairs: changes when a file is added or grows."""
    h = hashlib.sha256()
    for name, size in entries:
        h.update(f"{name}\0{size}\n".encode())
    return h.hexdigest()[:16]


def _signature(roots: list[Path]) -> str:
    """The digest of every file below ``roots`` (locks left out)."""
    return _digest((f"{root.name}/{f.relative_to(root)}", f.stat().st_size)
                   for root in roots for f in cache_files(root))


def text_signature(corpus: Path) -> str:
    """The digest of the teacher's text files below ``corpus`` (``TEXT_FILES``; what a job adds beside them, e.g.
    token caches, left out)."""
    return _digest((f, (corpus / f).stat().st_size) for f in TEXT_FILES)


def _room(dest: Path, max_files: int, max_bytes: int) -> tuple[int, int]:
    files = [p for p in dest.rglob("*") if p.is_file()] if dest.is_dir() else []
    return max_files - len(files), max_bytes - sum(p.stat().st_size for p in files)


def harvest(job: str, dest: Path, runs: Path = RUNS, inductor: Path | None = None, triton: Path | None = None,
            max_files: int = OUT_FILES, max_bytes: int = OUT_BYTES, carried: Path | None = None) -> list[Path]:
    """Into ``dest``: the teacher's text of ``job`` (once made) and the compile cache (when it grew), each only
    if it changed since the last harvest and fits beside what ``dest`` holds; the files written. ``carried``: the
    file where ``setup`` left the signature of a teacher's text it extracted (that text is not sent)."""
    from headscope.io import write_bytes, write_text

    dest, runs = Path(dest), Path(runs)
    record_path = runs / f"{job}.harvest.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    written: list[Path] = []
    corpus = runs / f".repo_{job}" / "data" / "corpus"
    if all((corpus / f).is_file() for f in TEXT_FILES):
        sig = text_signature(corpus)
        if carried is not None and carried.is_file() and carried.read_text().strip() == sig \
                and record.get("teacher_text") != sig:
            record["teacher_text"] = sig
            say("harvest: the teacher's text came carried: not sent")
        if record.get("teacher_text") != sig:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w:xz") as tar:
                for f in TEXT_FILES:
                    tar.add(corpus / f, arcname=f)
            files, room = _room(dest, max_files, max_bytes)
            if files >= 1 and len(buf.getvalue()) <= room:
                written.append(write_bytes(dest / TEXT_ARCHIVE, buf.getvalue()))
                record["teacher_text"] = sig
                say(f"harvest: the teacher's text, {len(buf.getvalue()) / 1e6:.1f} MB xz")
            else:
                say(f"harvest: no room for the teacher's text ({len(buf.getvalue()) / 1e6:.1f} MB) beside "
                    f"{max_files - files} files in {dest}; the next command sends it")
    roots = [inductor or inductor_dir(), triton or triton_dir()]
    sig = _signature(roots)
    if any(r.is_dir() for r in roots) and record.get("compile_cache") != sig:
        files, room = _room(dest, max_files, max_bytes)
        cap = min(45 * 2**20, room - 2**20, files * 15 * 2**20 - 2**20)  # an archive ends up to ~1 MiB past its cap
        parts = compile_cache_save(dest, *roots, max_bytes=cap) if files >= 1 and cap >= 2**20 else []
        _, left = _room(dest, max_files, max_bytes)
        if parts and (len(parts) > files or left < 0):
            for p in parts:
                p.unlink()
            parts = []
        if parts:
            written += parts
            record["compile_cache"] = sig
        else:
            say(f"harvest: no room for the compile cache beside what {dest} holds; the next command sends it")
    write_text(record_path, json.dumps(record, indent=1) + "\n")
    if not written:
        say("harvest: nothing new")
    return written


def stow(files: list[Path], repo: Path, split_corpus=None, unpack=None) -> dict[str, list[str]]:
    """Put files a GPU machine sent back (``harvest``'s, ``pack``'s) where the next lease reads them; what went
    where. ``split_corpus`` / ``unpack``: research.stage's, passed in (this module does not import it)."""
    from headscope.io import write_bytes

    files = [Path(f) for f in files]
    done: dict[str, list[str]] = {}
    text = [f for f in files if f.name == TEXT_ARCHIVE]
    if text:
        corpus = repo / "data" / "corpus"
        with tarfile.open(text[-1], "r:xz") as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
            names = sorted(m.name for m in members)
            if names != sorted(TEXT_FILES):
                raise ValueError(f"{text[-1]} holds {names}, not {list(TEXT_FILES)}: not harvest's archive")
            for m in members:  # each file whole or not at all (a temporary name, then renamed)
                extract_file(tar, m, corpus, keep=False)
        done["teacher_text"] = [str(corpus / f) for f in TEXT_FILES]
        if split_corpus is not None:
            done["corpus_parts"] = [str(p) for p in split_corpus()]
    compile_parts = sorted((f for f in files if COMPILE_RE.match(f.name)),
                           key=lambda f: int(COMPILE_RE.match(f.name)["k"]))
    if compile_parts:
        n = int(COMPILE_RE.match(compile_parts[0].name)["n"])
        if sorted(int(COMPILE_RE.match(f.name)["k"]) for f in compile_parts) != list(range(1, n + 1)):
            raise ValueError(f"compile-cache parts {[f.name for f in compile_parts]}: not one whole set of {n}; "
                             "stow the files of one command's folder")
        stage = repo / ".stage"
        for old in stage.glob("compile_cache.tgz.part*"):
            old.unlink()  # an older set: the new one holds what it held and what was compiled since
        for f in compile_parts:
            write_bytes(stage / f.name, f.read_bytes())
        done["compile_cache"] = [str(stage / f.name) for f in compile_parts]
    packs: dict[str, list[Path]] = {}
    for f in files:
        m = PACK_RE.match(f.name)
        if m and not COMPILE_RE.match(f.name):
            packs.setdefault(m["name"], []).append(f)
    if unpack is not None:
        for name, parts in sorted(packs.items()):
            done.setdefault("results", []).append(str(unpack(parts, repo / "runs")))
    handled = set(text) | set(compile_parts) | {f for parts in packs.values() for f in parts}
    left = [f.name for f in files if f not in handled]
    if left:
        say(f"stow: left where they are: {', '.join(left)}")
    return done
