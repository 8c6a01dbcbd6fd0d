"""The row format every evaluation returns (long format: one measured value per row)."""
from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["COLUMNS", "row", "accuracy_rows"]

COLUMNS = ["evaluation", "metric", "value", "n", "context_length", "depth", "n_keys", "family", "size", "phrasing",
           "position", "prompt_tokens", "status", "note"]


def row(evaluation: str, metric: str, value: float | None, n: int | None = None, status: str = "ok",
        **fields: Any) -> dict[str, Any]:
    unknown = sorted(set(fields) - set(COLUMNS))
    if unknown:
        raise ValueError(f"row fields {unknown} are not columns; columns: {COLUMNS}")
    out = {c: None for c in COLUMNS}
    out.update(fields, evaluation=evaluation, metric=metric, n=n, status=status,
               value=math.nan if value is None else float(value))
    return out


def accuracy_rows(evaluation: str, fields: dict[str, Any], results: Sequence[dict], generate: bool) -> list[dict]:
    """Generation accuracy (metric "accuracy", the headline) and teacher-forced accuracy of one cell."""
    n = len(results)
    tokens = sum(r["prompt_tokens"] for r in results) / max(1, n)
    out = []
    if generate:
        out.append(row(evaluation, "accuracy", sum(r["gen"] for r in results) / n, n, prompt_tokens=tokens, **fields))
    out.append(row(evaluation, "accuracy_teacher_forced", sum(r["tf"] for r in results) / n, n,
                   prompt_tokens=tokens, **fields))
    return out


def stop_rows(evaluation: str, fields: dict[str, Any], status: str, note: str, generate: bool) -> list[dict]:
    metrics = (["accuracy"] if generate else []) + ["accuracy_teacher_forced"]
    return [row(evaluation, m, None, 0, status=status, note=note, **fields) for m in metrics]
