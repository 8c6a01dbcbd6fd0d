"""Building the tokenized prompts of many (task, config, n, seed) cells: in this process, or in worker
processes started with "spawn", never "fork".

Why not fork: the evaluating process holds threads (CUDA's, tqdm's monitor, torch's pools), and a child forked
from a multi-threaded process inherits every lock in the state it had at the fork; one that another thread held
stays locked forever in the child, which then hangs (a timing-dependent deadlock: python/cpython#105464,
gh-90622). The H200 run of 2026-12-01 stalled that way: single-key NIAH printed its lengths up to 4088 tokens,
then nothing until the call's limit, with the 8184-token prompts (about 10 s of work in one process) being built
in a forked pool (docs/evaluation.md, "GPU"). Spawned workers start clean (about 1.5 s each, once per
``evaluate`` call, in parallel) and get the tokenizer pickled. They run only this module's functions, so they
are started without re-importing the caller's script (a script without ``if __name__ == "__main__":`` works, and
its top-level code does not run again in each worker). If the workers cannot start or die, the prompts are
built in this process (with a warning).

Prompts come back as plain lists and numpy arrays, not torch tensors: torch shares tensors between processes
through file descriptors and /dev/shm, which a container may keep small.

    with PromptBuilder(tokenizer, workers=8) as builder:
        job = builder.submit(cells)        # starts building in the workers (in-process: built at result())
        ...                                # score something else meanwhile
        per_cell = job.result()            # [list[TokenizedPair] | str (why the cell cannot be built)]
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import pickle
import sys
import warnings
from typing import Any, Iterator, Sequence

import torch

__all__ = ["PromptBuilder", "BuildJob", "prompt_builder", "build_cells", "default_workers", "Cell"]

Cell = tuple[str, dict[str, Any], int, int]  # (task name, task config, n samples, seed)
Part = tuple[str, dict[str, Any], int, int, int, int]  # a cell's samples lo..hi-1
_TOKENIZER: Any = None  # the tokenizer of this process's builds (a worker's: unpickled by _init_worker)
_ACTIVE: contextvars.ContextVar["PromptBuilder | None"] = contextvars.ContextVar("headscope_prompt_builder",
                                                                                 default=None)


def default_workers(cuda: bool) -> int:
    """Worker processes by default: with a GPU, one per CPU core this process may use but one, at most 16
    (building prompts is CPU work that would leave the GPU idle); on a CPU none (the cores score)."""
    if not cuda:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(0, min(16, cores - 1))


def _make_task(name: str, config: dict[str, Any]):
    if name == "niah_phrased":
        from headscope.evaluate.phrasings import PhrasedNiahTask

        return PhrasedNiahTask(**config)
    from headscope.tasks import get_task

    return get_task(name, **config)


def _tensor_fields(tp) -> list[str]:
    return [f.name for f in dataclasses.fields(tp) if isinstance(getattr(tp, f.name), torch.Tensor)]


def _pack(tp) -> tuple[type, dict[str, Any]]:
    """A TokenizedPair as (class, fields) with its tensors as numpy arrays (pickled by value)."""
    fields = {f.name: getattr(tp, f.name) for f in dataclasses.fields(tp)}
    for k in _tensor_fields(tp):
        fields[k] = fields[k].numpy()
    return type(tp), fields


def _unpack(packed: tuple[type, dict[str, Any]]):
    import numpy as np

    cls, fields = packed
    return cls(**{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()})


def _build(part: Part, packed: bool = False) -> list | str:
    """Samples lo..hi-1 of a cell, or why they cannot be built (the first line of a PairError)."""
    from headscope.tasks import PairError

    name, config, n, seed, lo, hi = part
    try:
        task = _make_task(name, config)
        out = [task.sample(_TOKENIZER, i, n, seed)[1] for i in range(lo, hi)]
    except PairError as err:
        return str(err).splitlines()[0]
    return [_pack(tp) for tp in out] if packed else out


def _build_packed(part: Part) -> list | str:
    return _build(part, packed=True)


def _init_worker(tokenizer_bytes: bytes) -> None:
    global _TOKENIZER
    torch.set_num_threads(1)
    _TOKENIZER = pickle.loads(tokenizer_bytes)


def _parts(cells: Sequence[Cell], workers: int) -> tuple[list[Part], list[int]]:
    """Cells cut into parts of a few samples (about two parts per worker), and the cell of each part."""
    per_cell = max(1, -(-2 * workers // len(cells))) if workers > 0 and cells else 1
    parts, owner = [], []
    for c, (name, config, n, seed) in enumerate(cells):
        k = min(n, per_cell)
        bounds = [round(n * j / k) for j in range(k + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            parts.append((name, config, n, seed, lo, hi))
            owner.append(c)
    return parts, owner


def _gather(n_cells: int, owner: list[int], results: list) -> list:
    out: list = [[] for _ in range(n_cells)]
    for c, res in zip(owner, results):
        if isinstance(out[c], str):
            continue
        out[c] = res if isinstance(res, str) else out[c] + res
    return out


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """While worker processes start: the parent's ``__main__`` shows no file and no module spec, which is how
    multiprocessing's spawn leaves the main module alone in the child (as for an interactive session) instead
    of re-running the calling script there. The workers need nothing from it."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    had_file, file = hasattr(main, "__file__"), getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    try:
        if had_file:
            del main.__file__
        main.__spec__ = None
        yield
    finally:
        main.__spec__ = spec
        if had_file:
            main.__file__ = file


class BuildJob:
    """Cells being built; ``result()`` waits for them: per cell a list of TokenizedPair or a reason string."""

    def __init__(self, builder: "PromptBuilder", cells: Sequence[Cell], futures: list | None, owner: list[int],
                 parts: list[Part]):
        self._builder, self._cells, self._futures = builder, list(cells), futures
        self._owner, self._parts = owner, parts
        self._result: list | None = None

    def result(self, timeout: float | None = None) -> list:
        """Per cell: its pairs, or why it cannot be built. ``timeout``: seconds to wait for the workers at most
        (``concurrent.futures.TimeoutError`` after that; in this process the building is not interrupted)."""
        if self._result is None:
            res = None
            if self._futures is not None:
                import time
                from concurrent.futures import TimeoutError
                from concurrent.futures.process import BrokenProcessPool

                try:
                    if timeout is not None:
                        end = time.monotonic() + timeout
                        try:
                            for f in self._futures:
                                f.result(timeout=max(0.0, end - time.monotonic()))
                        except TimeoutError:
                            self._builder._stuck = True  # close() does not wait for these workers
                            raise
                    res = [f.result() for f in self._futures]
                    res = [r if isinstance(r, str) else [_unpack(p) for p in r] for r in res]
                except BrokenProcessPool as err:
                    self._builder._give_up(err)
            if res is None:  # in this process
                res = self._builder._local(self._parts)
            self._result = _gather(len(self._cells), self._owner, res)
        return self._result

    def cancel(self) -> None:
        for f in self._futures or ():
            f.cancel()


class PromptBuilder:
    """Builds cells in this process (``workers=0``) or in ``workers`` spawned processes (started at the first
    ``submit``, kept until ``close``). A tokenizer that cannot be pickled is built in this process (warned)."""

    def __init__(self, tokenizer: Any, workers: int = 0):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers={workers!r}: give an int >= 0")
        self.tokenizer, self.workers, self.requested = tokenizer, workers, workers
        self._pool = None
        self._stuck = False  # a result timed out: close() ends the workers instead of waiting for them
        self._tok_bytes: bytes | None = None
        if workers > 0:
            try:
                self._tok_bytes = pickle.dumps(tokenizer)
            except Exception as err:  # noqa: BLE001 - any pickling failure means: build here
                warnings.warn(f"the tokenizer cannot be pickled ({type(err).__name__}: {err}); prompts are built "
                              "in this process (workers=0)", stacklevel=2)
                self.workers = 0

    def _local(self, parts: list[Part]) -> list:
        global _TOKENIZER
        prev, _TOKENIZER = _TOKENIZER, self.tokenizer
        try:
            return [_build(p) for p in parts]
        finally:
            _TOKENIZER = prev

    def _executor(self):
        if self._pool is None:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                             initializer=_init_worker, initargs=(self._tok_bytes,))
        return self._pool

    def _give_up(self, err: BaseException) -> None:
        warnings.warn(f"the prompt-building worker processes failed ({type(err).__name__}: {err}); building the "
                      "prompts in this process from now on (workers=0)", stacklevel=3)
        pool, self._pool, self.workers = self._pool, None, 0
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def submit(self, cells: Sequence[Cell]) -> BuildJob:
        parts, owner = _parts(cells, self.workers)
        if self.workers == 0 or len(parts) <= 1:
            return BuildJob(self, cells, None, owner, parts)
        from concurrent.futures.process import BrokenProcessPool

        try:
            with _without_main():  # workers start inside submit (all of them at the first one)
                pool = self._executor()
                futures = [pool.submit(_build_packed, p) for p in parts]
        except BrokenProcessPool as err:
            self._give_up(err)
            return BuildJob(self, cells, None, owner, parts)
        return BuildJob(self, cells, futures, owner, parts)

    def build(self, cells: Sequence[Cell]) -> list:
        return self.submit(cells).result()

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if not self._stuck:
            pool.shutdown(wait=True, cancel_futures=True)
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:  # still building what nobody waits for any more
            proc.terminate()

    def __enter__(self) -> "PromptBuilder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def prompt_builder(tokenizer: Any, workers: int, activate: bool = False) -> Iterator[PromptBuilder]:
    """The builder of the running ``evaluate`` call if it has this tokenizer and worker count, else a new one
    (closed on exit). ``activate=True``: a new builder that the evaluations inside the block share."""
    active = _ACTIVE.get()
    if not activate and active is not None and active.tokenizer is tokenizer and active.requested == workers:
        yield active
        return
    with PromptBuilder(tokenizer, workers) as builder:
        token = _ACTIVE.set(builder) if activate else None
        try:
            yield builder
        finally:
            if token is not None:
                _ACTIVE.reset(token)


def build_cells(tokenizer: Any, cells: Sequence[Cell], workers: int = 0) -> list:
    """Each cell's tokenized pairs (``task.tokenized(tokenizer, n, seed)``), or why it cannot be built."""
    with prompt_builder(tokenizer, workers) as builder:
        return builder.build(cells)
