"""Building a config dataclass from a dict (a TOML table, JSON, keyword arguments), refusing unknown fields.

    cfg = from_dict(NiahConfig, {"n": 4}, where="task 'niah'")          # NiahConfig(n=4)
    from_dict(NiahConfig, {"colour": 1}, where="task 'niah'")
    # ValueError: task 'niah': unknown field(s) ['colour']; known fields: ['n', 'lengths', ...]

Every config loader of the project goes through here, so a misspelt field is always named together with the
fields that exist, whatever file or call it came from.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

__all__ = ["from_dict", "check_fields"]

C = TypeVar("C")


def check_fields(cls: type, data: Any, *, where: str, error: type[Exception] = ValueError,
                 unknown_text: str = "unknown field(s)") -> None:
    """Raise ``error`` unless ``data`` is a mapping whose keys are all fields of the dataclass ``cls``.

    The message starts with ``where`` (what is being read, e.g. "stages[0]" or "task 'niah'") and names the
    unknown fields (as given, sorted) and the known ones (in declaration order); ``unknown_text`` is the phrase
    before the unknown names."""
    if not isinstance(data, Mapping):
        raise error(f"{where}: expected a table of {cls.__name__} fields, got {type(data).__name__}")
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise error(f"{where}: {unknown_text} {unknown}; known fields: {known}")


def from_dict(cls: type[C], data: Any, *, where: str, error: type[Exception] = ValueError,
              unknown_text: str = "unknown field(s)", tuples: bool = False) -> C:
    """``cls(**data)`` for the dataclass ``cls``; ``data`` already a ``cls`` is returned as is.

    Unknown fields and missing required ones raise ``error`` naming them (see ``check_fields``); ``tuples``:
    list values become tuples (what TOML / JSON give for the tuples a frozen dataclass holds). Errors the
    dataclass's own ``__post_init__`` raises pass through unchanged."""
    if isinstance(data, cls):
        return data
    check_fields(cls, data, where=where, error=error, unknown_text=unknown_text)
    kw = dict(data)
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kw
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise error(f"{where}: missing required field(s) {missing}")
    if tuples:
        for k, v in kw.items():
            if isinstance(v, list):
                kw[k] = tuple(v)
    return cls(**kw)
