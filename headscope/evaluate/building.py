"""Building the tokenized prompts of many (task, config, n, seed) cells: in this process, or shared between this
process and worker processes started with "spawn", never "fork".

Why not fork: the evaluating process holds threads (CUDA's, tqdm's monitor, torch's pools), and a child forked
from a multi-threaded process inherits every lock in the state it had at the fork; one that another thread held
stays locked forever in the child, which then hangs (a timing-dependent deadlock: python/cpython#105464,
gh-90622). The H200 run of 2026-12-01 stalled that way (docs/evaluation.md, "GPU").

Work sharing: a job's cells are cut into parts that go on one task queue; the workers take parts first come
first served, and so does this process whenever it waits for a result that is not there yet. Spawned workers
take seconds to start (importing torch and transformers: about 3 s alone on the 2-core CPU, 44 s for 15 at once
on the H200's 16 cores), so the first prompts of a run are built here meanwhile instead of waited for; later
lengths are built by the workers while this process scores. A part's prompts depend only on the part, never on
which process built it. The workers run only ``headscope._prompt_worker`` (no re-import of the caller's script:
a script without ``if __name__ == "__main__":`` works) and get the tokenizer pickled. A worker that dies makes
this process build the rest itself (with a warning); a part that raised in a worker is built again here, where
its error is raised.

Prompts come back as plain lists and numpy arrays, not torch tensors: torch shares tensors between processes
through file descriptors and /dev/shm, which a container may keep small.

    with PromptBuilder(tokenizer, workers=8) as builder:
        job = builder.submit(cells)        # queued for the workers (in-process: built at result())
        ...                                # score something else meanwhile
        per_cell = job.result()            # [list[TokenizedPair] | str (why the cell cannot be built)]
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import pickle
import queue
import sys
import time
import warnings
from typing import Any, Iterator, Sequence

import torch

from headscope._prompt_worker import CANCEL_SLOTS, Failed, build_part, worker_main

__all__ = ["PromptBuilder", "BuildJob", "prompt_builder", "build_cells", "default_workers", "Cell"]

Cell = tuple[str, dict[str, Any], int, int]  # (task name, task config, n samples, seed)
Part = tuple[str, dict[str, Any], int, int, int, int]  # a cell's samples lo..hi-1
_ACTIVE: contextvars.ContextVar["PromptBuilder | None"] = contextvars.ContextVar("headscope_prompt_builder",
                                                                                 default=None)
MAX_DEFAULT_WORKERS = 8


def default_workers(cuda: bool) -> int:
    """Worker processes by default: with a GPU, one per CPU core this process may use but one, at most 8
    (building prompts is CPU work that would leave the GPU idle; 8 keep the full suite's longest prompts ahead
    of the scoring, and more only lengthen the start-up, when every worker imports torch at once); on a CPU
    none (the cores score)."""
    if not cuda:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(0, min(MAX_DEFAULT_WORKERS, cores - 1))


def _unpack(packed: tuple[type, dict[str, Any]]):
    import numpy as np

    cls, fields = packed
    return cls(**{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()})


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
    multiprocessing's spawn leaves the main module alone in the child (as for an interactive interpreter) instead
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


class _Workers:
    """``n`` spawned worker processes, one task queue and one result queue (``headscope._prompt_worker``)."""

    def __init__(self, n: int, tokenizer_bytes: bytes, start_delay: float = 0.0):
        import multiprocessing as mp

        self.context = mp.get_context("spawn")
        self.tasks, self.results = self.context.Queue(), self.context.Queue()
        self.cancelled = self.context.Array("b", CANCEL_SLOTS, lock=False)
        self.procs = [self.context.Process(target=worker_main, daemon=True, name=f"headscope-prompts-{i}",
                                           args=(tokenizer_bytes, self.tasks, self.results, self.cancelled,
                                                 start_delay)) for i in range(n)]
        with _without_main():
            for proc in self.procs:
                proc.start()

    def dead(self) -> list[int]:
        return [p.exitcode for p in self.procs if p.exitcode is not None]

    def close(self, wait: float) -> None:
        """Ends the workers: a stop for each, then up to ``wait`` seconds to finish the part in hand (results
        read and dropped meanwhile, so none blocks on a full pipe), then terminated (one still starting up is
        not waited for: nothing it holds is needed any more)."""
        for i in range(CANCEL_SLOTS):
            self.cancelled[i] = 1
        for _ in self.procs:
            self.tasks.put(None)
        end = time.monotonic() + wait
        while any(p.is_alive() for p in self.procs) and time.monotonic() < end:
            try:
                self.results.get(timeout=0.05)
            except (queue.Empty, EOFError, OSError):
                pass
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(5)
        for q in (self.tasks, self.results):
            q.cancel_join_thread()
            q.close()


class BuildJob:
    """Cells being built; ``result()`` waits for them: per cell a list of TokenizedPair or a reason string."""

    def __init__(self, builder: "PromptBuilder", cells: Sequence[Cell], job_id: int | None, owner: list[int],
                 parts: list[Part]):
        self._builder, self._cells, self._id = builder, list(cells), job_id
        self._owner, self._parts = owner, parts
        self._result: list | None = None

    def result(self, timeout: float | None = None) -> list:
        """Per cell: its pairs, or why it cannot be built. While a part it needs is not back from the workers,
        this process builds parts still on the queue itself (first come first served), and waits only when
        every part left is in a worker's hands. ``timeout``: seconds to wait at most
        (``concurrent.futures.TimeoutError`` after that; a part being built in this process is finished)."""
        if self._result is None:
            if self._id is None:  # in this process
                res = self._builder._local(self._parts)
            else:
                res = self._builder._wait(self._id, len(self._parts), timeout)
            self._result = _gather(len(self._cells), self._owner, res)
        return self._result

    def cancel(self) -> None:
        if self._id is not None and self._result is None:
            self._builder._cancel(self._id)


class PromptBuilder:
    """Builds cells in this process (``workers=0``), or shared between this process and ``workers`` spawned
    processes (started at the first ``submit``, kept until ``close``; see the module docstring). ``share=False``:
    this process only waits for the workers (tests of stuck workers use it). A tokenizer that cannot be pickled
    is built in this process (warned)."""

    worker_start_delay: float = 0.0  # seconds each worker sleeps before its first part (tests: a slow start-up)
    share_work: bool = True  # the default of ``share``

    def __init__(self, tokenizer: Any, workers: int = 0, share: bool | None = None):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers={workers!r}: give an int >= 0")
        self.tokenizer, self.workers, self.requested = tokenizer, workers, workers
        self.share = self.share_work if share is None else share
        self._pool: _Workers | None = None
        self._next_id = 0
        self._done: dict[tuple[int, int], Any] = {}  # (job, part) -> result, as they come back
        self._cancelled: set[int] = set()
        self._parts_of: dict[int, list[Part]] = {}
        self._stuck = False  # a result timed out: close() ends the workers instead of waiting for them
        self.built_here = 0  # parts this process built while it waited (work sharing)
        self._tok_bytes: bytes | None = None
        if workers > 0:
            try:
                self._tok_bytes = pickle.dumps(tokenizer)
            except Exception as err:  # noqa: BLE001 - any pickling failure means: build here
                warnings.warn(f"the tokenizer cannot be pickled ({type(err).__name__}: {err}); prompts are built "
                              "in this process (workers=0)", stacklevel=2)
                self.workers = 0

    def _local(self, parts: list[Part]) -> list:
        return [build_part(p, self.tokenizer) for p in parts]

    def _executor(self) -> _Workers:
        if self._pool is None:
            self._pool = _Workers(self.workers, self._tok_bytes, self.worker_start_delay)
        return self._pool

    def _give_up(self, err: BaseException | str) -> None:
        warnings.warn(f"the prompt-building worker processes failed ({err}); building the prompts in this process "
                      "from now on (workers=0)", stacklevel=3)
        pool, self._pool, self.workers = self._pool, None, 0
        if pool is not None:
            pool.close(wait=0.0)

    def _cancel(self, job: int) -> None:
        self._cancelled.add(job)
        if self._pool is not None:
            self._pool.cancelled[job % CANCEL_SLOTS] = 1
        for key in [k for k in self._done if k[0] == job]:
            del self._done[key]
        self._parts_of.pop(job, None)

    def _collect(self, timeout: float) -> bool:
        """Moves the results that came back into ``_done``, waiting up to ``timeout`` s for the first."""
        pool, got = self._pool, False
        while pool is not None:
            try:
                job, index, res = pool.results.get(timeout=timeout) if timeout > 0 else pool.results.get_nowait()
            except queue.Empty:
                return got
            timeout, got = 0, True
            if job not in self._cancelled:
                self._done[(job, index)] = res
        return got

    def _take(self) -> tuple[int, int, Part] | None:
        """A part still on the task queue (any job's, the oldest first), or None."""
        while self._pool is not None:
            try:
                item = self._pool.tasks.get_nowait()
            except queue.Empty:
                return None
            if item is None:
                continue
            if item[0] not in self._cancelled:
                return item
        return None

    def _wait(self, job: int, n: int, timeout: float | None) -> list:
        from concurrent.futures import TimeoutError

        end = None if timeout is None else time.monotonic() + timeout
        out: dict[int, Any] = {}
        while len(out) < n:
            self._collect(0)
            for i in range(n):
                if i not in out and (job, i) in self._done:
                    res = self._done.pop((job, i))
                    if isinstance(res, _Built):  # built here while waiting for another job
                        out[i] = res.value
                    elif isinstance(res, Failed):  # built again here: its error raised as without workers
                        out[i] = self._local([self._part(job, i)])[0]
                    else:
                        out[i] = res if isinstance(res, str) else [_unpack(p) for p in res]
            if len(out) == n:
                break
            if self._pool is None:  # the workers failed: the rest here
                for i in range(n):
                    if i not in out:
                        out[i] = self._local([self._part(job, i)])[0]
                break
            if end is not None and time.monotonic() >= end:
                self._stuck = True  # close() does not wait for these workers
                raise TimeoutError()
            item = self._take() if self.share else None
            if item is not None:  # work sharing: this process builds a queued part itself
                j, i, part = item
                res = build_part(part, self.tokenizer)
                self.built_here += 1
                if j == job:
                    out[i] = res
                else:
                    self._done[(j, i)] = _Built(res)
                continue
            if self._pool.dead():
                self._give_up(f"a worker exited with code {self._pool.dead()[0]}")
                continue
            left = 0.1 if end is None else max(0.0, min(0.1, end - time.monotonic()))
            self._collect(left)
        self._forget(job)
        return [out[i] for i in range(n)]

    def _part(self, job: int, index: int) -> Part:
        return self._parts_of[job][index]

    def _forget(self, job: int) -> None:
        self._parts_of.pop(job, None)

    def submit(self, cells: Sequence[Cell]) -> BuildJob:
        parts, owner = _parts(cells, self.workers)
        if self.workers == 0 or len(parts) <= 1:
            return BuildJob(self, cells, None, owner, parts)
        try:
            pool = self._executor()  # workers start at the first submit
        except Exception as err:  # noqa: BLE001 - cannot start processes here: build in this process
            self._give_up(f"{type(err).__name__}: {err}")
            return BuildJob(self, cells, None, owner, parts)
        job, self._next_id = self._next_id, self._next_id + 1
        self._parts_of[job] = parts
        for i, part in enumerate(parts):
            pool.tasks.put((job, i, part))
        return BuildJob(self, cells, job, owner, parts)

    def build(self, cells: Sequence[Cell]) -> list:
        return self.submit(cells).result()

    def close(self) -> None:
        pool, self._pool = self._pool, None
        self._done.clear()
        if pool is not None:
            pool.close(wait=0.0 if self._stuck else 1.0)

    def __enter__(self) -> "PromptBuilder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Built:
    """A part of another job that this process built while it waited (kept as it is, not packed)."""

    def __init__(self, value: Any):
        self.value = value


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
