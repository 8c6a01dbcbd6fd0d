"""The teacher's side of the fidelity evaluations, kept on disk and read back for the next student.

Comparing several students (hybrids of one teacher: seeds, recipes, study rows) with one teacher repeats the
teacher's own work each time: its greedy continuations and chat answers, its NLL of those answers, its NIAH
accuracy. ``evaluate(..., teacher=T, teacher_cache=DIR)`` stores each of them under ``DIR`` the first time and
reads them back afterwards. An entry is found only for the same teacher weights (a digest of every parameter and
buffer), dtype and device type, and the same inputs (prompts, settings and seed): anything else runs again. The
per-token text metrics (KL, top-1 agreement) need both models' logits at once and are not cached.

    cache = TeacherCache("runs/teacher_cache", teacher)
    answers = cache.run("continuation", {"prompts": prompts, "new": 32}, lambda: generate(teacher, prompts))
"""
from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["TeacherCache", "weights_digest", "tokenizer_digest", "rows_complete", "cached", "VERSION"]

VERSION = 1  # bump when what an entry holds changes meaning: old entries are then not found


_DIGESTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the model's state dict (every parameter and persistent buffer: names, shapes, dtypes and bytes), in
    name order. Remembered per model until a tensor is replaced or changed in place (its version counter moves), so
    evaluating one teacher many times reads its weights once."""
    state = sorted(model.state_dict().items())
    stamp = tuple((name, t.data_ptr(), t._version, t.dtype, tuple(t.shape), str(t.device)) for name, t in state)
    known = _DIGESTS.get(model)
    if known is not None and known[0] == stamp:
        return known[1]
    h = hashlib.sha256()
    for name, t in state:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    _DIGESTS[model] = (stamp, h.hexdigest())
    return h.hexdigest()


def rows_complete(rows: list[dict]) -> bool:
    """Whether every row ran (status "ok"): the ``keep`` of a cached teacher side, so that rows a time budget or an
    out-of-memory stop cut short are not kept."""
    return all(r.get("status") == "ok" for r in rows)


class TeacherCache:
    """``run(kind, key, fn)``: ``fn()``'s JSON-serialisable value, computed once per (teacher, kind, key)."""

    def __init__(self, folder: str | Path, teacher: torch.nn.Module):
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise NotADirectoryError(f"teacher_cache={str(folder)!r} is a file: give a folder (it is created if "
                                     "missing)")
        self._model = teacher
        self.hits = 0
        self.misses = 0

    @property
    def teacher(self) -> dict:
        """What ties an entry to the teacher: its weights' digest, dtype and device type (read at first use, so an
        evaluation that caches nothing never hashes the weights)."""
        p = next(self._model.parameters())
        return {"weights": weights_digest(self._model), "dtype": str(p.dtype), "device": p.device.type}

    def _path(self, kind: str, key: Any, teacher: dict) -> Path:
        blob = json.dumps({"version": VERSION, "kind": kind, "teacher": teacher, "key": key}, sort_keys=True,
                          default=str)
        return self.folder / f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:24]}.json"

    def run(self, kind: str, key: Any, fn: Callable[[], Any], keep: Callable[[Any], bool] | None = None) -> Any:
        """The stored value for (``kind``, ``key``), else ``fn()``, stored unless ``keep(value)`` is False (e.g.
        rows cut short by a time budget). A damaged entry is computed again."""
        from headscope.io import write_text

        teacher = self.teacher
        path = self._path(kind, key, teacher)
        if path.is_file():
            try:
                value = json.loads(path.read_text())["value"]
                self.hits += 1
                return value
            except (ValueError, KeyError):
                pass
        value = fn()
        if keep is not None and not keep(value):
            return value
        self.folder.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps({"version": VERSION, "kind": kind, "teacher": teacher, "value": value}))
        self.misses += 1
        return value


def tokenizer_digest(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id) and special tokens: prompts built from text depend on it."""
    vocab = sorted(tokenizer.get_vocab().items()) if hasattr(tokenizer, "get_vocab") else repr(tokenizer)
    special = getattr(tokenizer, "all_special_tokens", [])
    return hashlib.sha256(json.dumps([vocab, list(special)], default=str).encode()).hexdigest()


def cached(ctx, kind: str, key: Any, fn: Callable[[], Any], keep: Callable[[Any], bool] | None = None) -> Any:
    """``fn()`` through the evaluation context's teacher cache, or directly without one."""
    cache = getattr(ctx, "teacher_cache", None)
    return fn() if cache is None else cache.run(kind, key, fn, keep)
