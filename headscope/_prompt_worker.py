"""The prompt-building worker process of ``headscope.evaluate.building``: the only code a spawned worker runs.

Kept outside ``headscope.evaluate`` so that a worker imports as little as possible: this module (standard
library only at import), then, for its first part, ``headscope.tasks`` (torch) and whatever unpickling the
tokenizer needs (transformers for a Hugging Face tokenizer). Not pandas, plotly, or the evaluation package:
15 workers importing all that at once on 16 cores took 44 s on the H200 (docs/evaluation.md, "GPU").

A worker takes ``(job, index, part)`` items from one task queue, first come first served (the evaluating
process takes items from the same queue while it waits, see ``building.BuildJob.result``), and puts
``(job, index, result)`` on the result queue; ``None`` ends it. A part's prompts depend only on the part
(task, config, n, seed, sample range), never on which process built them.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import time
from typing import Any

__all__ = ["build_part", "worker_main", "Failed", "CANCEL_SLOTS"]

CANCEL_SLOTS = 4096  # job ids modulo this index the shared "cancelled" flags


class Failed(str):
    """A part that raised in a worker (its traceback): the evaluating process builds it again itself, where the
    error is raised as it would be without workers."""


def make_task(name: str, config: dict[str, Any]):
    if name == "niah_phrased":
        from headscope.evaluate.phrasings import PhrasedNiahTask

        return PhrasedNiahTask(**config)
    from headscope.tasks import get_task

    return get_task(name, **config)


def pack(tp) -> tuple[type, dict[str, Any]]:
    """A TokenizedPair as (class, fields) with its tensors as numpy arrays (pickled by value, no torch shared
    memory: a container may keep /dev/shm small)."""
    import dataclasses

    import torch

    fields = {f.name: getattr(tp, f.name) for f in dataclasses.fields(tp)}
    return type(tp), {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in fields.items()}


def build_part(part: tuple, tokenizer: Any, packed: bool = False) -> list | str:
    """Samples lo..hi-1 of a cell ``part = (name, config, n, seed, lo, hi)``, or why they cannot be built (the
    first line of a PairError)."""
    from headscope.tasks import PairError

    name, config, n, seed, lo, hi = part
    try:
        task = make_task(name, config)
        out = [task.sample(tokenizer, i, n, seed)[1] for i in range(lo, hi)]
    except PairError as err:
        return str(err).splitlines()[0]
    return [pack(tp) for tp in out] if packed else out


def worker_main(tokenizer_bytes: bytes, tasks, results, cancelled, start_delay: float = 0.0) -> None:
    """The worker's loop (see the module docstring). ``start_delay``: seconds to sleep before anything else
    (tests use it to stand for a slow start-up)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: one thread per worker
    with contextlib.suppress(OSError, AttributeError):
        os.nice(5)  # the evaluating process (feeding the GPU, building the first prompts) goes first
    if start_delay:
        time.sleep(start_delay)
    # everything a part needs is imported before the first part is taken from the queue: a worker still
    # starting up holds no part that the evaluating process could be building meanwhile
    import torch

    import headscope.tasks  # noqa: F401

    torch.set_num_threads(1)
    tokenizer = pickle.loads(tokenizer_bytes)
    while True:
        item = tasks.get()
        if item is None:
            return
        job, index, part = item
        if cancelled[job % CANCEL_SLOTS]:
            continue
        try:
            res: Any = build_part(part, tokenizer, packed=True)
        except Exception:  # noqa: BLE001 - reported; the evaluating process builds the part again and raises
            import traceback

            res = Failed(traceback.format_exc())
        results.put((job, index, res))
