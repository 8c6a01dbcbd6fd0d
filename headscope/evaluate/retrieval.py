"""Retrieval evaluations: single-key NIAH by length x depth, multi-key NIAH by length, template transfer.

Lengths run from short to ``8 x`` the training length; a length past the model's positions, one whose
prompt cannot be built (the needles alone overflow it) or one that runs out of memory gives rows with
``status`` "skipped" / "stopped" and a ``note`` saying why (after an out-of-memory stop, longer lengths
are not tried), and so does a length that the evaluation's time budget does not reach ("skipped", the note
starting with "budget:"). Lengths past a RoPE model's ``max_position_embeddings`` run, and are said before they
do with an estimate of their time: a warning when they were asked for explicitly or lie far past the training
length (``headscope.evaluate.lengths``).
"""
from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from headscope.evaluate.engine import score_pairs
from headscope.evaluate.rows import accuracy_rows, row, stop_rows
from headscope.evaluate.runtime import (BudgetExceeded, EvalContext, check_lengths_fit, context_lengths, free_memory,
                                        is_oom, fewer_rows_after_oom)

__all__ = ["NiahEvalConfig", "MultikeyEvalConfig", "TemplateTransferConfig", "niah", "niah_multikey",
           "template_transfer", "LENGTH_MULTIPLES", "DEPTHS"]

LENGTH_MULTIPLES = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # of the training length
DEPTHS = tuple(round(0.1 * i, 1) for i in range(11))


def _check_common(cfg) -> None:
    if not isinstance(cfg.n, int) or isinstance(cfg.n, bool) or cfg.n < 1:
        raise ValueError(f"n={cfg.n!r}: give an int >= 1 (prompts per cell)")
    if any(not isinstance(x, int) or x < 32 for x in cfg.lengths):
        raise ValueError(f"lengths={cfg.lengths!r}: give ints >= 32 (tokens), or () to use multiples")
    if not cfg.lengths and (not cfg.multiples or any(not isinstance(m, (int, float)) or m <= 0 for m in cfg.multiples)):
        raise ValueError(f"multiples={cfg.multiples!r}: give positive multiples of the training length")
    if not isinstance(cfg.haystack, str) or not cfg.haystack:
        raise ValueError(f"haystack={cfg.haystack!r}: give 'heldout', 'train', or a text file path")


@dataclass(frozen=True)
class NiahEvalConfig:
    lengths: tuple[int, ...] = ()  # absolute prompt lengths (tokens); () -> multiples of the training length
    multiples: tuple[float, ...] = LENGTH_MULTIPLES
    depths: tuple[float, ...] = DEPTHS
    n: int = 8  # prompts per (length, depth)
    haystack: str = "heldout"
    generate: bool = True

    def __post_init__(self):
        _check_common(self)
        if len(self.depths) < 1 or any(not isinstance(d, (int, float)) or not 0 <= d <= 1 for d in self.depths):
            raise ValueError(f"depths={self.depths!r}: give fractions in [0, 1]")


@dataclass(frozen=True)
class MultikeyEvalConfig:
    lengths: tuple[int, ...] = ()
    multiples: tuple[float, ...] = LENGTH_MULTIPLES
    n_keys: tuple[int, ...] = (2, 4, 8)
    n: int = 20  # prompts per (length, keys)
    haystack: str = "heldout"
    generate: bool = True

    def __post_init__(self):
        _check_common(self)
        if not self.n_keys or any(not isinstance(k, int) or not 1 <= k <= 20 for k in self.n_keys):
            raise ValueError(f"n_keys={self.n_keys!r}: give ints in [1, 20]")


@dataclass(frozen=True)
class TemplateTransferConfig:
    lengths: tuple[int, ...] = ()
    multiples: tuple[float, ...] = (0.25, 1.0)
    phrasings: tuple[str, ...] = ("trained", "code", "pin", "plain")
    n: int = 20  # prompts per (length, phrasing), needle depths spread evenly
    haystack: str = "heldout"
    generate: bool = True

    def __post_init__(self):
        from headscope.evaluate.phrasings import PHRASINGS

        _check_common(self)
        bad = [p for p in self.phrasings if p not in PHRASINGS]
        if not self.phrasings or bad:
            raise ValueError(f"phrasings={self.phrasings!r}: give names from {sorted(PHRASINGS)}")


Cell = tuple[dict[str, Any], str, dict[str, Any], int, int]  # (row fields, task name, task config, n, seed)


def by_length(model, tokenizer, ctx: EvalContext, evaluation: str, lengths: Iterable[int],
              cells: Callable[[int], list[Cell]], generate: bool,
              extra: Callable[[int, list, list], list[dict]] | None = None) -> list[dict]:
    """Rows for each length's cells, shortest first, with clean stops (see the module docstring).

    With worker processes (``ctx.workers``) the next length's prompts are built while this one is scored.
    Each length logs a start and a done line with its seconds (``ctx.log``). Once the evaluation's time budget
    (``ctx.deadline``) is spent, the length being scored and every longer one give "skipped" rows whose note
    starts with "budget:"."""
    from headscope.evaluate.building import prompt_builder

    device = next(model.parameters()).device
    lengths = list(lengths)
    rows: list[dict] = []
    stop: tuple[str, str] | None = None

    def runnable(L: int) -> bool:
        return stop is None and not ctx.over_budget() and check_lengths_fit(model, L) is None

    def stopped(L: int, status: str, note: str) -> list[dict]:
        return [r for fields, *_ in cells(L) for r in stop_rows(evaluation, fields, status, note, generate)]

    with prompt_builder(tokenizer, ctx.workers) as builder:
        jobs: dict[int, Any] = {}
        for k, L in enumerate(lengths):
            if stop is None and (why := check_lengths_fit(model, L)):
                stop = ("skipped", why)
            if stop is None and ctx.over_budget():
                stop = ("skipped", ctx.budget_note(f"{evaluation} at {L} tokens and longer"))
            if stop is not None:
                rows += stopped(L, *stop)
                continue
            t0 = time.perf_counter()
            cs = cells(L)
            ctx.log(f"{evaluation} @{L}: start ({len(cs)} cells, {sum(c[3] for c in cs)} prompts)")
            job = jobs.pop(L, None) or builder.submit([tuple(c[1:]) for c in cs])
            nxt = lengths[k + 1] if k + 1 < len(lengths) else None
            if builder.workers and nxt is not None and runnable(nxt):  # built in the workers meanwhile
                jobs[nxt] = builder.submit([tuple(c[1:]) for c in cells(nxt)])
            try:
                per_cell = job.result(timeout=ctx.seconds_left())
            except FuturesTimeout:
                stop = ("skipped", ctx.budget_note(f"{evaluation} at {L} tokens and longer"))
                rows += stopped(L, *stop)
                ctx.log(f"{evaluation} @{L}: budget spent waiting {time.perf_counter() - t0:.1f} s for the prompts "
                        "from the workers; this length and longer ones skipped")
                continue
            done: list[dict] = []
            built: list[tuple[dict, list]] = []
            for (fields, *_), pairs in zip(cs, per_cell):
                if isinstance(pairs, str):
                    done += stop_rows(evaluation, fields, "skipped", pairs, generate)
                else:
                    built.append((fields, pairs))
            all_pairs = [p for _, pairs in built for p in pairs]
            t_built = time.perf_counter() - t0
            try:  # every cell of this length in one batched pass (one prompt at a time after running out of memory)
                all_res = _score_or_retry(model, tokenizer, all_pairs, ctx, generate, f"{evaluation} @{L}")
            except BudgetExceeded:
                stop = ("skipped", ctx.budget_note(f"{evaluation} at {L} tokens and longer"))
                rows += stopped(L, *stop)
                ctx.log(f"{evaluation} @{L}: budget spent after {time.perf_counter() - t0:.1f} s; "
                        "this length and longer ones skipped")
                continue
            except Exception as err:  # noqa: BLE001 - only out-of-memory is handled, the rest re-raised
                if not is_oom(err):
                    raise
                free_memory(device)
                stop = ("stopped", f"out of memory at {L} tokens on {device}: longer lengths not tried")
                rows += stopped(L, *stop)
                ctx.log(f"{evaluation} @{L}: out of memory; longer lengths not tried")
                continue
            at = 0
            for fields, pairs in built:
                done += accuracy_rows(evaluation, fields, all_res[at:at + len(pairs)], generate)
                at += len(pairs)
            rows += done
            if extra is not None and all_pairs:
                rows += extra(L, all_pairs, all_res)
            ctx.log(f"{evaluation} @{L}: done in {time.perf_counter() - t0:.1f} s ({len(all_pairs)} prompts; "
                    f"waited {t_built:.1f} s for them)")
        for job in jobs.values():
            job.cancel()
    return rows


def _score_or_retry(model, tokenizer, pairs: list, ctx: EvalContext, generate: bool, desc: str) -> list[dict]:
    if not pairs:
        return []
    return fewer_rows_after_oom(lambda c: score_pairs(model, tokenizer, pairs, c, generate=generate, desc=desc), ctx,
                                pairs[0].seq_len, next(model.parameters()).device)


def _say_past_positions(model, evaluation: str, lengths: list[int], cells: Callable[[int], list[Cell]], cfg,
                        ctx: EvalContext) -> None:
    """Lengths past the model's positions, said before they run with an estimate (headscope.evaluate.lengths)."""
    from headscope.evaluate.lengths import check_positions

    check_positions(model, evaluation, lengths, lambda L: sum(c[3] for c in cells(L)), explicit=bool(cfg.lengths),
                    log=ctx.log)


def _cell_seed(seed: int, length: int, index: int) -> int:
    return seed * 1_000_003 + length * 101 + index


def niah(model, tokenizer, cfg: NiahEvalConfig, ctx: EvalContext) -> list[dict]:
    """Single-key NIAH accuracy by context length x needle depth (+ values never asked in training)."""
    from headscope.tasks.niah import is_heldout_value

    def cells(L):
        return [({"context_length": L, "depth": float(d)}, "niah",
                 {"context_length": L, "depth": float(d), "haystack": cfg.haystack},
                 cfg.n, _cell_seed(ctx.seed, L, i)) for i, d in enumerate(cfg.depths)]

    def unseen(L, pairs, res):
        sel = [r for p, r in zip(pairs, res) if is_heldout_value(p.pair.clean_answer)]
        if not sel:
            return []
        key = "gen" if cfg.generate else "tf"
        return [row("niah", "accuracy_unseen_values", sum(r[key] for r in sel) / len(sel), len(sel),
                    context_length=L, note="values divisible by 7: never asked in the reference model's training")]

    lengths = context_lengths(model, cfg.lengths, cfg.multiples)
    _say_past_positions(model, "niah", lengths, cells, cfg, ctx)
    return by_length(model, tokenizer, ctx, "niah", lengths, cells, cfg.generate, extra=unseen)


def niah_multikey(model, tokenizer, cfg: MultikeyEvalConfig, ctx: EvalContext) -> list[dict]:
    """Multi-key NIAH (n_keys keyed needles, one asked) accuracy by context length and key count."""
    def cells(L):
        return [({"context_length": L, "n_keys": k}, "niah_multikey",
                 {"context_length": L, "n_keys": k, "depth": "random", "haystack": cfg.haystack},
                 cfg.n, _cell_seed(ctx.seed, L, 50 + k)) for k in cfg.n_keys]

    lengths = context_lengths(model, cfg.lengths, cfg.multiples)
    _say_past_positions(model, "niah_multikey", lengths, cells, cfg, ctx)
    return by_length(model, tokenizer, ctx, "niah_multikey", lengths, cells, cfg.generate)


def template_transfer(model, tokenizer, cfg: TemplateTransferConfig, ctx: EvalContext) -> list[dict]:
    """Single-key NIAH in phrasings other than the trained one ("trained" is the control)."""
    def cells(L):
        return [({"context_length": L, "phrasing": p, "family": "trained" if p == "trained" else "transfer"},
                 "niah_phrased", {"context_length": L, "depth": "uniform", "haystack": cfg.haystack, "phrasing": p},
                 cfg.n, _cell_seed(ctx.seed, L, 80 + i)) for i, p in enumerate(cfg.phrasings)]

    lengths = context_lengths(model, cfg.lengths, cfg.multiples)
    _say_past_positions(model, "template_transfer", lengths, cells, cfg, ctx)
    return by_length(model, tokenizer, ctx, "template_transfer", lengths, cells, cfg.generate)
