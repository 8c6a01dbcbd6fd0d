"""The held-out data of the fidelity evaluation: text sources and chat instructions shipped with the package.

``headscope/evaluate/data/fidelity/sources.json`` is the manifest: one entry per held-out source,

    {"<source>": {"domain": ..., "licence": ..., "origin": "<package==version, file path inside>",
                  "file": "<name>.txt"}}

``file`` is a path relative to the manifest's folder (the Shakespeare source points at the haystack text that
``headscope.tasks`` already ships). Entries whose file ends in ``.txt`` are text sources; ``.jsonl`` entries are
instruction sets (one JSON object per line with ``instruction``, ``topic`` and ``kind``), listing their
``topics`` and ``kinds``.

    list_sources()                        # the shipped text sources, e.g. ["shakespeare", "python_code", ...]
    load_sources(("python_code", "my.txt"))  # [(name, text)]: names from the manifest or paths to UTF-8 files
    load_instructions()                   # the shipped chat instructions: [{"instruction", "topic", "kind"}]
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

__all__ = ["DATA", "MANIFEST", "UnknownSourceError", "manifest", "list_sources", "source_path", "read_utf8",
           "load_source", "load_sources", "load_instructions"]

DATA = Path(__file__).resolve().parent / "data" / "fidelity"
MANIFEST = DATA / "sources.json"
_FIELDS = ("domain", "licence", "origin", "file")


class UnknownSourceError(LookupError):
    """A held-out source that is neither in the manifest nor a file."""


def manifest() -> dict[str, dict]:
    """The manifest's entries by name, each checked to have domain, licence, origin and file."""
    if not MANIFEST.is_file():
        raise FileNotFoundError(f"the held-out data manifest {MANIFEST} is missing; reinstall headscope")
    data = json.loads(read_utf8(MANIFEST))
    if not isinstance(data, dict):
        raise ValueError(f"{MANIFEST}: give an object {{source name: entry}}")
    for name, entry in data.items():
        missing = [f for f in _FIELDS if not isinstance(entry, dict) or not isinstance(entry.get(f), str)]
        if missing:
            raise ValueError(f"{MANIFEST}: entry {name!r} lacks the string field(s) {missing} (each entry needs "
                             f"{list(_FIELDS)})")
    return data


def list_sources() -> list[str]:
    """The shipped text sources (manifest entries whose file ends in .txt), in manifest order."""
    return [n for n, e in manifest().items() if e["file"].endswith(".txt")]


def _known() -> str:
    return ", ".join(list_sources())


def source_path(spec: str | os.PathLike, suffix: str = ".txt") -> tuple[str, Path]:
    """(name, file) of a held-out source: a manifest name, or a path to a file (named by its stem)."""
    entries = manifest()
    if isinstance(spec, str) and spec in entries:
        entry = entries[spec]
        if not entry["file"].endswith(suffix):
            raise ValueError(f"held-out source {spec!r} is a {Path(entry['file']).suffix} file, not {suffix}")
        path = (DATA / entry["file"]).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"held-out source {spec!r}: its file {path} is missing (sources.json names "
                                    f"{entry['file']!r}); reinstall headscope or fix the manifest entry")
        return spec, path
    if not isinstance(spec, (str, os.PathLike)) or not str(spec):
        raise ValueError(f"held-out source {spec!r}: give a name ({_known()}) or a path to a UTF-8 text file")
    path = Path(spec).expanduser()
    looks_like_path = path.suffix or os.sep in str(spec) or path.exists()
    if not looks_like_path:
        raise UnknownSourceError(f"unknown held-out source {str(spec)!r}; known sources: {_known()} (or give a path "
                                 "to a UTF-8 text file)")
    if not path.is_file():
        raise FileNotFoundError(f"held-out source {str(spec)!r}: no such file; give a path to a UTF-8 text file or "
                                f"a known source ({_known()})")
    return path.stem, path.resolve()


def read_utf8(path: str | os.PathLike) -> str:
    """The file's text; a file that is not UTF-8 is a ValueError saying where it is not."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); convert it to UTF-8 "
                         "(e.g. iconv -t UTF-8) or give another file") from None


def load_source(spec: str | os.PathLike) -> tuple[str, str]:
    """(name, text) of one held-out source (see ``source_path``); an empty file is a ValueError."""
    name, path = source_path(spec)
    text = read_utf8(path)
    if not text.strip():
        raise ValueError(f"held-out source {name!r} ({path}) is empty")
    return name, text


def load_sources(specs: Sequence[str | os.PathLike] = ()) -> list[tuple[str, str]]:
    """[(name, text)] for each of ``specs`` (names or paths); () gives every shipped text source."""
    if isinstance(specs, (str, os.PathLike)):
        specs = (specs,)
    out = [load_source(s) for s in (tuple(specs) or tuple(list_sources()))]
    names = [n for n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"held-out sources {dup} appear twice (a path is named by its file's stem); give each once")
    return out


def load_instructions(spec: str | os.PathLike = "chat_heldout") -> list[dict]:
    """The instructions of a JSONL set (a manifest name or a path): one object per line with a non-empty
    ``instruction`` and optional ``topic`` and ``kind``."""
    name, path = source_path(spec, suffix=".jsonl")
    items = []
    for i, line in enumerate(read_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {i}: not JSON ({err.msg}); give one JSON object per line") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("instruction"), str) or not obj["instruction"].strip():
            raise ValueError(f"{path} line {i}: give an object with a non-empty string field 'instruction'")
        items.append({"instruction": obj["instruction"], "topic": str(obj.get("topic", "")),
                      "kind": str(obj.get("kind", ""))})
    if not items:
        raise ValueError(f"instruction set {name!r} ({path}) holds no instructions")
    return items
