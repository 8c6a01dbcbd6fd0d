"""The receiver-score engine (docs/method.md section 1) and the naive reference backend.

For every pair: run clean and corrupted, then for every head h re-run the clean prompt with only h's
slice of the output projection's input (``z  # [B, T, H*D]``) replaced by the corrupted run's value:

    S(h) = (M_clean - M_patched(h)) / (M_clean - M_corrupt)

A backend computes the metrics; ``receiver_scores`` checks the clean runs, normalizes and packs the
result into ``HeadScores``. ``NaiveBackend`` (one full forward per head, a pre-hook on out_projs[l])
is the test oracle that the fast backends must reproduce.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Protocol, Sequence

import torch
import torch.nn as nn

from headscope.arch import Arch, describe
from headscope.hooks import hooks, pre, record_inputs
from headscope.heads import Head
from headscope.metrics import Metric, greedy_correct
from headscope.patching.inputs import PatchPair
from headscope.patching.sharded import (Shard, all_reduce_sum, check_same_pairs, resolve_shard, supports_heads,
                                        work_share)
from headscope.results import HeadScores

__all__ = ["Backend", "NaiveBackend", "receiver_scores", "CleanFailureError", "DegeneratePairError",
           "patch_heads", "model_device"]


class CleanFailureError(RuntimeError):
    """The model does not solve the clean task well enough for its scores to mean anything."""


class DegeneratePairError(RuntimeError):
    """M_clean == M_corrupt: the corruption does not change the model's answer, so S = x / 0."""


class Backend(Protocol):
    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int

    def answer_logits(self, ids: torch.Tensor, answer_pos: torch.Tensor) -> torch.Tensor:
        """ids  # [T] -> logits at answer_pos  # [A, V]"""

    def patched_metrics(self, pair: PatchPair, metric: Metric, pbar=None) -> torch.Tensor:
        """M_patched of every head  # [L, H] float64. A backend that can also takes ``heads=`` (a list of
        Head): only those entries are computed (the rest are meaningless), for sharded scoring."""


def model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def head_jobs(n_layers: int, n_heads: int, heads: Sequence[Head] | None = None) -> list[tuple[int, int]]:
    """(layer, head) of every head in (layer, head) order, or of ``heads`` only (checked, sorted)."""
    if heads is None:
        return [(l, h) for l in range(n_layers) for h in range(n_heads)]
    jobs = sorted({(int(x.layer), int(x.head)) for x in heads})
    bad = [Head(l, h) for l, h in jobs if l >= n_layers or h >= n_heads]
    if bad:
        raise ValueError(f"heads {bad[:3]} are outside this model's {n_layers} layers x {n_heads} heads")
    return jobs


def head_batches(n_layers: int, n_heads: int, batch_size: int):
    """Every head in (layer, head) order, ``batch_size`` at a time, as (chunk, rows): chunk[b] = (layer, head)
    is patched by batch row b, and rows[layer] = [(b, head), ...] groups the rows by layer."""
    jobs = head_jobs(n_layers, n_heads)
    for i in range(0, len(jobs), batch_size):
        chunk = jobs[i:i + batch_size]
        rows: dict[int, list[tuple[int, int]]] = {}
        for b, (l, h) in enumerate(chunk):
            rows.setdefault(l, []).append((b, h))
        yield chunk, rows


@contextlib.contextmanager
def patch_heads(out_projs: Sequence[nn.Module], arch: Arch, jobs: Sequence[tuple[int, int]],
                z_corrupt: dict[int, torch.Tensor]) -> Iterator[None]:
    """Batch element i patches head jobs[i] = (layer, head): z[i, :, head_slice] <- z_corrupt[layer].

    z_corrupt[l]  # [1, T', H*D] covers the last T' positions of the run (all of them, or the suffix).
    """
    rows: dict[int, list[tuple[int, slice]]] = {}
    for i, (l, h) in enumerate(jobs):
        rows.setdefault(l, []).append((i, arch.head_slice(h)))

    def make_hook(l: int):
        def hook(module, args):
            z = args[0].clone()  # [B, T, H*D]
            zc = z_corrupt[l]  # [1, T, H*D]
            for i, sl in rows[l]:
                z[i, :, sl] = zc[0, :, sl]
            return (z,) + tuple(args[1:])
        return hook

    with hooks(pre(out_projs[l], make_hook(l)) for l in rows):
        yield


class NaiveBackend:
    """Reference: one full forward of the clean prompt per head, head h's z channels replaced."""

    name = "naive"

    def __init__(self, model: nn.Module):
        self.model = model
        self.arch = describe(model)
        self.n_layers, self.n_heads, self.n_kv_heads = self.arch.n_layers, self.arch.n_heads, self.arch.n_kv_heads
        self.device = model_device(model)

    def _logits(self, ids: torch.Tensor, answer_pos: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids.to(self.device), use_cache=False)
        return out.logits[:, answer_pos.to(self.device)].float()  # [B, A, V]

    @torch.inference_mode()
    def answer_logits(self, ids: torch.Tensor, answer_pos: torch.Tensor) -> torch.Tensor:
        return self._logits(ids[None], answer_pos)[0]  # [A, V]

    @torch.inference_mode()
    def patched_metrics(self, pair: PatchPair, metric: Metric, pbar=None,
                        heads: Sequence[Head] | None = None) -> torch.Tensor:
        with record_inputs(self.arch.out_projs) as z_corrupt:
            self._logits(pair.corrupt_ids[None], pair.answer_pos)
        out = torch.zeros(self.n_layers, self.n_heads, dtype=torch.float64)  # [L, H]
        for l, h in head_jobs(self.n_layers, self.n_heads, heads):
            with patch_heads(self.arch.out_projs, self.arch, [(l, h)], z_corrupt):
                logits = self._logits(pair.clean_ids[None], pair.answer_pos)  # [1, A, V]
            out[l, h] = metric(logits, pair)[0]
            if pbar is not None:
                pbar.update(1)
        return out


def receiver_scores(backend: Backend, pairs: Sequence[PatchPair], metric: Metric, *, task: str = "custom",
                    progress: bool = True, on_clean_failure: str = "warn", min_clean_accuracy: float = 0.5,
                    denom_eps: float = 1e-4, settings: dict | None = None, shard: str | None = None) -> HeadScores:
    """Receiver scores of every head on every pair, normalized per pair.

    Clean check: greedy teacher-forced exact match of the clean answer. If the accuracy is below
    ``min_clean_accuracy``: "warn" warns, "error" raises CleanFailureError; "drop" always drops the
    pairs the model gets wrong (raising if none is left).
    Degenerate pairs (|M_clean - M_corrupt| <= denom_eps * max(|M_clean|, 1)) are dropped with a
    warning; if every pair is degenerate, DegeneratePairError is raised.
    shard: "heads" | "samples" | "auto" splits the work over the processes of torch.distributed (torchrun)
    and gathers the scores on every rank (headscope.patching.sharded); None: this process does everything.
    """
    if on_clean_failure not in ("warn", "drop", "error"):
        raise ValueError(f"on_clean_failure={on_clean_failure!r}; use 'warn', 'drop' or 'error'")
    if not pairs:
        raise ValueError("no pairs to score: pass n_samples >= 1 or a non-empty list of pairs")
    sharding = resolve_shard(shard, len(pairs))  # None: one process
    if sharding is not None:
        if sharding.mode == "heads" and not supports_heads(backend):
            raise ValueError(f"shard='heads': the {backend.name!r} backend cannot score a subset of heads; use "
                             "shard='samples' (or a backend that can: 'hf', 'naive')")
        check_same_pairs(pairs, task)
    m_clean, m_corrupt, correct = [0.0] * len(pairs), [0.0] * len(pairs), [False] * len(pairs)
    mine = range(len(pairs)) if sharding is None else range(sharding.rank, len(pairs), sharding.world)
    for i in mine:  # sharded: each rank checks its share of the pairs, then every rank gets all the numbers
        p = pairs[i]
        lc = backend.answer_logits(p.clean_ids, p.answer_pos)  # [A, V]
        lx = backend.answer_logits(p.corrupt_ids, p.answer_pos)  # [A, V]
        m_clean[i], m_corrupt[i] = float(metric(lc, p)[0]), float(metric(lx, p)[0])
        correct[i] = greedy_correct(lc, p.clean_answer_ids)
    if sharding is not None:  # one rank computed each entry, the others add exact zeros: the same on every rank
        clean = all_reduce_sum(torch.tensor([m_clean, m_corrupt, correct], dtype=torch.float64))  # [3, N]
        m_clean, m_corrupt = clean[0].tolist(), clean[1].tolist()
        correct = [bool(c) for c in clean[2].tolist()]
    acc = sum(correct) / len(correct)
    keep = list(range(len(pairs)))
    dropped: dict[int, str] = {}
    if acc < min_clean_accuracy and on_clean_failure == "error":
        raise CleanFailureError(
            f"the model answers only {acc:.0%} of the clean prompts of task {task!r} correctly (greedy, teacher-"
            f"forced; need >= {min_clean_accuracy:.0%}): scores of a task the model cannot do are noise. Fix: use a "
            "task/context length the model solves, or pass on_clean_failure='drop' / 'warn'")
    if on_clean_failure == "drop":
        for i in keep:
            if not correct[i]:
                dropped[i] = "clean answer wrong"
        keep = [i for i in keep if correct[i]]
        if not keep:
            raise CleanFailureError(f"the model answers none of the {len(pairs)} clean prompts of task {task!r} "
                                    "correctly, so on_clean_failure='drop' leaves nothing to score. Fix: use a "
                                    "task/context length the model solves")
        if dropped:
            warnings.warn(f"dropped {len(dropped)} of {len(pairs)} pairs of task {task!r} whose clean answer the "
                          f"model gets wrong (clean accuracy {acc:.0%})", stacklevel=3)
    elif acc < min_clean_accuracy:
        warnings.warn(f"the model answers only {acc:.0%} of the clean prompts of task {task!r} correctly (need >= "
                      f"{min_clean_accuracy:.0%}); its head scores may be noise. Pass on_clean_failure='drop' to "
                      "score only the pairs it solves", stacklevel=3)
    degenerate = [i for i in keep if abs(m_clean[i] - m_corrupt[i]) <= denom_eps * max(abs(m_clean[i]), 1.0)]
    if degenerate and len(degenerate) == len(keep):
        raise DegeneratePairError(
            f"M_clean - M_corrupt is ~0 for every pair of task {task!r} (e.g. {m_clean[keep[0]]:.4g} vs "
            f"{m_corrupt[keep[0]]:.4g}): the corruption does not change the model's answer, so the normalized score "
            "is undefined. Fix: corrupt the answer-bearing span (a different needle value), or use metric='logprob'")
    if degenerate:
        warnings.warn(f"dropped {len(degenerate)} pair(s) {degenerate} of task {task!r} whose corruption does not "
                      "change the metric (M_clean ~= M_corrupt): the score would be x/0", stacklevel=3)
        for i in degenerate:
            dropped[i] = "corruption does not change the metric"
        keep = [i for i in keep if i not in set(degenerate)]

    m_patched = _patched(backend, pairs, keep, metric, task, progress, sharding)  # [N, L, H]
    rows = [(m_clean[i] - m_patched[j]) / (m_clean[i] - m_corrupt[i]) for j, i in enumerate(keep)]
    per_sample = torch.stack(rows)  # [N, L, H]
    if not torch.isfinite(per_sample).all():
        raise FloatingPointError("non-finite receiver scores (NaN/inf logits?); check the model's dtype")
    info = dict(settings or {})
    info.update(backend=backend.name, metric=metric.name, n_pairs=len(pairs), n_scored=len(keep),
                clean_accuracy=acc, dropped={str(k): v for k, v in sorted(dropped.items())},
                on_clean_failure=on_clean_failure, denom_eps=denom_eps)
    if sharding is not None:
        info.update(shard=sharding.mode, world_size=sharding.world)
    idx = torch.tensor(keep)
    return HeadScores(task=task, per_sample_raw=per_sample, kind="receiver", n_kv_heads=backend.n_kv_heads,
                      clean_metric=torch.tensor(m_clean, dtype=torch.float64)[idx],
                      corrupt_metric=torch.tensor(m_corrupt, dtype=torch.float64)[idx],
                      clean_correct=torch.tensor(correct)[idx], settings=info)


def _patched(backend: Backend, pairs: Sequence[PatchPair], keep: list[int], metric: Metric, task: str,
             progress: bool, sharding: Shard | None) -> torch.Tensor:
    """M_patched of every head on the kept pairs  # [N, L, H] float64: all here, or this rank's share, summed
    over the ranks (each entry computed by one rank; the others add exact zeros)."""
    L, H = backend.n_layers, backend.n_heads
    mine_pairs, heads = work_share(sharding, len(keep), L, H)
    owned = torch.ones(L, H, dtype=torch.bool) if heads is None else torch.zeros(L, H, dtype=torch.bool)  # [L, H]
    for h in heads or ():  # the heads this process computes
        owned[h.layer, h.head] = True
    bar = None
    if progress and (sharding is None or sharding.rank == 0):
        from tqdm.auto import tqdm
        where = "" if sharding is None else f", rank 0 of {sharding.world}"
        bar = tqdm(total=int(owned.sum()) * len(mine_pairs), desc=f"receiver scores ({backend.name}, {task}{where})",
                   unit="head")
    out = torch.zeros(len(keep), L, H, dtype=torch.float64)  # [N, L, H]
    try:
        for j in mine_pairs:
            pair = pairs[keep[j]]
            m = backend.patched_metrics(pair, metric, bar) if heads is None else \
                backend.patched_metrics(pair, metric, bar, heads=heads)  # [L, H]
            out[j] = torch.where(owned, m.to(torch.float64), torch.zeros((), dtype=torch.float64))
    finally:
        if bar is not None:
            bar.close()
    return out if sharding is None else all_reduce_sum(out)
