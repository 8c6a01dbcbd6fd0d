"""The one micro-batch runner: run jobs ``batch_size`` at a time, halving the size on out-of-memory.

    for chunk, logits in micro_batches(jobs, run_chunk, batch_size=16, device=model_device(model)):
        ...                                     # chunk: the jobs that produced logits  # [len(chunk), ...]

``run(chunk)`` is called on consecutive slices of ``jobs``. When it raises an out-of-memory error
(``torch.OutOfMemoryError``, or a RuntimeError whose message says "out of memory", as CPU allocators
and older CUDA builds report it), the size is halved, the CUDA cache emptied, and the same slice retried
with fewer jobs; an out-of-memory error at size 1, and every other error, is raised as is. The smaller
size is kept for the rest of the jobs, and reported to ``on_shrink(new_size)`` so a caller can keep it
for its next call. Used by the receiver (patching/hf.py) and sender (patching/path.py) engines.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch

__all__ = ["micro_batches", "is_oom"]

J = TypeVar("J")
R = TypeVar("R")


def is_oom(err: BaseException) -> bool:
    """True for an out-of-memory error (CUDA, or an allocator's RuntimeError saying so)."""
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError)
                                                       and "out of memory" in str(err).lower())


def _free_cache(device: Any) -> None:
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def micro_batches(jobs: Sequence[J], run: Callable[[Sequence[J]], R], batch_size: int, *, device: Any = None,
                  on_shrink: Callable[[int], None] | None = None) -> Iterator[tuple[Sequence[J], R]]:
    """Yield ``(chunk, run(chunk))`` over consecutive chunks of ``jobs`` (see the module docstring)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"micro_batches: batch_size must be an int >= 1, got {batch_size!r}")
    i = 0
    while i < len(jobs):
        chunk = jobs[i:i + batch_size]
        try:
            out = run(chunk)
        except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
            if not is_oom(err) or batch_size == 1:
                raise
            batch_size = max(1, batch_size // 2)
            _free_cache(device)
            if on_shrink is not None:
                on_shrink(batch_size)
            continue
        yield chunk, out
        i += len(chunk)
