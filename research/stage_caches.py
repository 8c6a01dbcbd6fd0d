"""The caches a fresh GPU machine restores so that it does not redo earlier machines' work (``python -m
research.stage`` runs these; its docstring has the routine):

- Triton's autotuning results (``triton-cache``): fla's kernels autotune on first use; small ``*.autotune.json``
  archives committed to ``research/gpu_cache/triton_autotune_*.tgz``.
- The fidelity suites' teacher side (``teacher-cache``): ``headscope.evaluate``'s ``teacher_cache`` entries,
  committed to ``research/gpu_cache/teacher_cache_*.tgz``.
- The compiled code (``compile-cache``): torch.compile's on-disk caches (inductor's FX graphs, AOTAutograd entries
  and the Triton kernels they built) and Triton's own kernel cache (fla's kernels). Too large for the repository
  (megabytes of binaries), so they travel like the GGUF: ``save`` writes ``compile_cache.tgz.partKofN`` parts to
  ``$OUT``, which go to ``.stage/`` here and are carried back, one part a command; ``setup`` extracts them once all
  are there. On the CPU the SmolLM2 hybrid's first compiled forward + backward took 77 s cold and 5.0 s with the
  cache extracted into a fresh folder (docs/research.md).
"""
from __future__ import annotations

import io
import os
import re
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_CACHE = REPO / "research" / "gpu_cache"
# the fidelity suites' teacher side on the remote machine: where research/train_hybrid/overlap.sh points
# HEADSCOPE_TEACHER_CACHE (RUNS/teacher_cache, RUNS=/tmp/runs by default)
TEACHER_CACHE = Path("/tmp/runs/teacher_cache")
COMPILE_RE = re.compile(r"^compile_cache\.tgz\.part(?P<k>\d+)of(?P<n>\d+)$")
PART_RE = re.compile(r"^(?P<model>.+)\.gguf\.part(?P<k>\d+)of(?P<n>\d+)$")  # `split`'s GGUF parts
CORPUS_RE = re.compile(r"^corpus\.tar\.xz\.part(?P<k>\d+)of(?P<n>\d+)$")  # `split-corpus`'s parts
COMPILE_PART = 15 * 2**20  # bytes: below the 16 MiB a returned file may have


class StageError(RuntimeError):
    """A staging step that cannot go on; the message names the fix."""


def say(msg: str) -> None:
    print(f"[stage] {msg}", flush=True)


def _save_archive(archive: Path, files: list[Path], root: Path, what: str, noun: str) -> int:
    """``files`` (below ``root``, named relative to it) into the .tgz ``archive`` (written whole or not at all); how
    many."""
    from headscope.io import write_bytes

    if not files:
        say(f"{what}: no {noun} in {root}")
        return 0
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(root)))
    write_bytes(archive, buf.getvalue())
    say(f"{what}: saved {len(files)} {noun} to {archive}")
    return len(files)


def extract_file(tar: tarfile.TarFile, member: tarfile.TarInfo, root: Path, keep: bool) -> bool:
    """A regular file of ``tar`` into ``root`` (a name that would leave ``root`` is refused: tarfile's data
    filter), written whole or not at all, so a cut restore leaves no half file in a cache; with ``keep``, a file
    already there stays. Whether it was written."""
    from headscope.io import write_bytes

    if not member.isfile():
        return False
    member = tarfile.data_filter(member, str(root))
    target = root / member.name
    if keep and target.exists():
        return False
    write_bytes(target, tar.extractfile(member).read())
    return True


# ----------------------------------------------------------------------------- Triton's autotuning results

def triton_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))


def triton_save(archive: Path, cache: Path | None = None) -> int:
    """Triton's autotuning results (``*.autotune.json``: small, no binaries) into ``archive``; how many. fla's
    kernels autotune on first use (~170 s per head shape on a bare H200); a machine of the same image that restores
    them compiles only the winning configs (Triton ignores a stale one: its hash differs)."""
    cache = cache or triton_dir()
    files = sorted(cache.rglob("*.autotune.json")) if cache.is_dir() else []
    return _save_archive(archive, files, cache, "triton-cache", "autotune results")


def triton_restore(archives: list[Path] | None = None, cache: Path | None = None) -> int:
    """Unpack the archives (default research/gpu_cache/triton_autotune_*.tgz) into Triton's cache; how many."""
    cache = cache or triton_dir()
    archives = sorted(GPU_CACHE.glob("triton_autotune_*.tgz")) if archives is None else archives
    cache.mkdir(parents=True, exist_ok=True)
    for a in archives:
        with tarfile.open(a, "r:gz") as tar:
            for m in tar.getmembers():
                extract_file(tar, m, cache, keep=False)
    say(f"triton-cache: restored {len(archives)} archive(s) into {cache}")
    return len(archives)


# ----------------------------------------------------------------------------- the fidelity suites' teacher side

def teacher_cache_dir() -> Path:
    return Path(os.environ.get("HEADSCOPE_TEACHER_CACHE") or TEACHER_CACHE)


def teacher_cache_save(archive: Path, cache: Path | None = None) -> int:
    """The entries of a ``headscope.evaluate`` teacher cache (``KIND-HASH.json``: the teacher's continuations, chat
    answers and their NLL, NIAH rows; small) into ``archive``; how many. Each entry is tied to the teacher's weights,
    dtype, device type and inputs, so a later machine that restores them evaluates only the students."""
    cache = cache or teacher_cache_dir()
    files = sorted(cache.glob("*.json")) if cache.is_dir() else []
    return _save_archive(archive, files, cache, "teacher-cache", "entries")


def teacher_cache_restore(archives: list[Path] | None = None, cache: Path | None = None) -> int:
    """Unpack the archives (default research/gpu_cache/teacher_cache_*.tgz) into the teacher cache
    ($HEADSCOPE_TEACHER_CACHE, else /tmp/runs/teacher_cache), entries already there kept; how many were added.
    Only flat ``*.json`` members are taken."""
    cache = cache or teacher_cache_dir()
    archives = sorted(GPU_CACHE.glob("teacher_cache_*.tgz")) if archives is None else archives
    added = 0
    for a in archives:
        with tarfile.open(a, "r:gz") as tar:
            for m in tar.getmembers():
                name = Path(m.name)
                if len(name.parts) == 1 and name.suffix == ".json":
                    added += extract_file(tar, m, cache, keep=True)
    if archives:
        say(f"teacher-cache: {added} entries from {len(archives)} archive(s) into {cache}")
    return added


# ----------------------------------------------------------------------------- torch.compile's and Triton's code

def inductor_dir() -> Path:
    """torch.compile's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, else inductor's default under the temp folder)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return Path(cache_dir())
    except ImportError:  # an older torch: the same default
        import getpass
        import tempfile

        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
        return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path(tempfile.gettempdir()) / f"torchinductor_{user}")


def cache_files(root: Path) -> list[Path]:
    """The files of a cache folder (``root``; none when it is absent) in name order: symbolic links and locks left
    out."""
    if not root.is_dir():
        return []
    return [f for f in sorted(root.rglob("*")) if f.is_file() and not f.is_symlink() and not f.name.endswith(".lock")]


def compile_cache_save(dest: Path, inductor: Path | None = None, triton: Path | None = None,
                       part_bytes: int = COMPILE_PART, max_bytes: int = 45 * 2**20) -> list[Path]:
    """torch.compile's cache folder, then Triton's kernel cache (every file but locks), as one .tgz in parts
    ``dest/compile_cache.tgz.partKofN`` of at most ``part_bytes``; the parts. Files past ``max_bytes`` of archive
    (about: gzip buffers) are left out, Triton's first, and said (a command returns at most 64 MiB)."""
    from headscope.io import write_bytes

    roots = {"inductor": inductor or inductor_dir(), "triton": triton or triton_dir()}
    buf = io.BytesIO()
    n_files, left_out = 0, 0
    # gzip's fastest level: compiled binaries shrink little at any level, and level 9 took ~20 s a save on 2 cores
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for name, root in roots.items():
            for f in cache_files(root):
                if buf.tell() + f.stat().st_size // 4 > max_bytes:  # a binary compresses ~2-4x
                    left_out += 1
                    continue
                tar.add(f, arcname=f"{name}/{f.relative_to(root)}")
                n_files += 1
    if left_out:
        say(f"compile-cache: {left_out} files left out past {max_bytes / 2**20:.0f} MiB (give --max-mb to keep more)")
    if not n_files:
        say(f"compile-cache: nothing in {roots['inductor']} or {roots['triton']}")
        return []
    data = buf.getvalue()
    n = -(-len(data) // part_bytes)
    dest.mkdir(parents=True, exist_ok=True)
    parts = []
    for k in range(n):
        p = dest / f"compile_cache.tgz.part{k + 1}of{n}"
        write_bytes(p, data[k * part_bytes:(k + 1) * part_bytes])  # atomic: a part is whole or absent
        parts.append(p)
    say(f"compile-cache: {n_files} files, {len(data) / 1e6:.1f} MB gz in {n} part(s) under {dest}; here, move them "
         "to .stage/ and carry one a command")
    return parts


def parts_in(folder: Path, stem: str, pattern: re.Pattern, n: int | None = None) -> list[Path]:
    """The files ``STEM.partKofN`` in ``folder`` that match ``pattern`` (groups k and n; of ``n`` parts if given),
    in the order of K."""
    found = [p for p in folder.glob(f"{stem}.part*{'' if n is None else f'of{n}'}") if pattern.match(p.name)]
    return sorted(found, key=lambda p: int(pattern.match(p.name)["k"]))


def collect_part(part: Path, stage_dir: Path, pattern: re.Pattern, stem: str, what: str) -> list[Path] | None:
    """One carried part ``STEM.partKofN`` (matching ``pattern``, groups k and n) copied into ``stage_dir`` (whole or
    not at all); all N parts there in order once they are all in, else None (and a line naming the missing ones)."""
    from headscope.io import write_bytes

    n = int(pattern.match(part.name)["n"])
    stage_dir.mkdir(parents=True, exist_ok=True)
    if part.resolve() != (stage_dir / part.name).resolve():
        write_bytes(stage_dir / part.name, part.read_bytes())
    have = parts_in(stage_dir, stem, pattern, n)
    if len(have) < n:
        names = [f"{stem}.part{k}of{n}" for k in range(1, n + 1)]
        missing = [name for name in names if not (stage_dir / name).is_file()]
        say(f"{what}: staged {part.name}; still missing: {', '.join(missing)} (carry them in the next commands)")
        return None
    return have


def put_compile_cache(part: Path, stage_dir: Path, inductor: Path | None = None,
                      triton: Path | None = None) -> bool:
    """One carried compile-cache part into ``stage_dir``; once all N are there, extract them into torch.compile's
    and Triton's cache folders (files already there kept) and drop the parts. True when extracted."""
    if not COMPILE_RE.match(part.name):
        raise ValueError(f"{part.name} is not a compile-cache part (compile_cache.tgz.partKofN from "
                         "`compile-cache save`)")
    have = collect_part(part, stage_dir, COMPILE_RE, "compile_cache.tgz", "compile-cache")
    if have is None:
        return False
    roots = {"inductor": inductor or inductor_dir(), "triton": triton or triton_dir()}
    added = 0
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in have)), mode="r:gz") as tar:
        for member in tar.getmembers():
            top, _, rest = member.name.partition("/")
            if top in roots and rest:
                added += extract_file(tar, member.replace(name=rest), roots[top], keep=True)
    for p in have:
        p.unlink()
    say(f"compile-cache: {added} files into {roots['inductor']} and {roots['triton']}")
    return True
