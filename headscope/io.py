"""Safe writes: every file the project writes goes through here (temporary file in the same folder, then
``os.replace``), so a full disk or a kill mid-write leaves the old file intact and never a half-written one.

    from headscope.io import atomic_write, write_text, check_output_path

    write_text("mask.json", text)                          # str
    with atomic_write("curve.csv") as f: df.to_csv(f)      # a binary-or-text handle, renamed on success
    check_output_path("mask.json", kind="headscope.head_mask", overwrite=False)   # before long work
"""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_write", "write_text", "write_bytes", "check_output_path", "OutputExistsError", "artifact_kind",
           "umask", "make_temp_dir", "file_sha256"]


class OutputExistsError(FileExistsError):
    """An output path holds a file that is not an artifact of the kind about to be written."""


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """The sha256 of a file's bytes, read in chunks (hex)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def umask() -> int:
    """The process's file-mode creation mask (read without changing it where /proc tells it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)  # elsewhere: set and restore at once
    os.umask(mask)
    return mask


def make_temp_dir(parent: str | os.PathLike, prefix: str, suffix: str = "") -> Path:
    """``tempfile.mkdtemp`` in ``parent`` with the mode a plain ``mkdir`` would give (mkdtemp's is 0700, which a
    folder renamed into place would keep: teammates could not read it)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=parent))
    tmp.chmod(0o777 & ~umask())
    return tmp


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8", *,
                 fsync: bool = True) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on a clean exit fsync it and rename it over ``path``.

    On any exception the temporary file is deleted and ``path`` is untouched. ``fsync=False`` skips the fsync: the
    rename still leaves the old file or the whole new one to any other process, but a machine that loses power
    may keep neither (for files that are written again anyway)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode={mode!r} must be 'w' or 'wb'")
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a folder; give a file path to write")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600; the file gets the mode open() would give it
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> Path:
    with atomic_write(path, "w", fsync=fsync) as f:
        f.write(text)
    return Path(path)


def write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> Path:
    with atomic_write(path, "wb", fsync=fsync) as f:
        f.write(data)
    return Path(path)


def artifact_kind(path: str | os.PathLike) -> str | None:
    """The ``schema`` field of a JSON artifact this project wrote (e.g. "headscope.head_mask"), else None."""
    p = Path(path)
    try:
        with open(p, encoding="utf-8") as f:
            head = f.read(1 << 20)
        data = json.loads(head)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data.get("schema") if isinstance(data, dict) else None


def check_output_path(path: str | os.PathLike, *, kind: str | None = None, overwrite: bool = False,
                      suffixes: tuple[str, ...] | None = None, flag: str = "--out") -> Path:
    """Check an output path before long work starts; return it as a Path.

    Refused: a folder; a suffix not in ``suffixes``; an existing file that is not an artifact of ``kind``
    (its JSON ``schema`` field) unless ``overwrite``. ``kind=None``: any existing file needs ``overwrite``.
    """
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"{flag} {p} is a folder; give a file path (e.g. {p / 'out.json'})")
    if suffixes is not None and p.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {p}: the file must end in one of {', '.join(suffixes)}")
    if p.exists() and not overwrite:
        if kind is None or artifact_kind(p) != kind:
            what = f"is not a {kind} file" if kind else "already exists"
            raise OutputExistsError(f"{flag} {p} {what}; refusing to overwrite it (pass --overwrite / "
                                    "overwrite=True, or choose another path)")
    parent = p.parent if str(p.parent) else Path(".")
    if parent.exists() and not os.access(parent, os.W_OK):
        raise PermissionError(f"{flag} {p}: the folder {parent} is not writable")
    return p
