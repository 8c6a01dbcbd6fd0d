"""Prompt lengths past a model's positions: said before they run, with an estimate of what they cost.

A RoPE model takes prompts longer than its ``max_position_embeddings`` (the retrieval suites measure how far its
retrieval extends, up to 8x its training length), but each prompt's cost grows with the square of its length, so
a length far past the positions (``niah.lengths=[99999]`` on a 2048-position model) can run for minutes or hours.
Before such lengths run, ``check_positions``:

- warns (``LengthWarning``) when a length was asked for explicitly (``lengths=...``) or lies past
  ``FAR_BEYOND`` x the training length (past what the suites themselves measure), naming the positions, the
  estimate and the fix (lengths within the positions, or a time budget);
- otherwise (the suite's own multiples) prints one line with the estimate (``ctx.log``).

The estimate times two forwards on the model as it is (a cost ``a L + b L^2`` fitted to them) and multiplies by
the prompts each length runs. Models whose positions end (learned position embeddings) skip such lengths instead
("skipped" rows), so they are not estimated.
"""
from __future__ import annotations

import time
import warnings
import weakref
from typing import Callable, Iterable

import torch
import torch.nn as nn

from headscope.evaluate.runtime import position_limit, training_length

__all__ = ["LengthWarning", "FAR_BEYOND", "configured_positions", "prompt_seconds", "check_positions", "format_seconds"]

FAR_BEYOND = 8.0  # x the training length: the longest the suites' own multiples go


class LengthWarning(UserWarning):
    """Prompt lengths past the model's positions (they run, slowly; the message has the estimate and the fix)."""


def configured_positions(model: nn.Module) -> int | None:
    """The positions the model's config declares (``max_position_embeddings`` / ``n_positions``), or None."""
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


_FITS: "weakref.WeakKeyDictionary[nn.Module, tuple[float, float, int]]" = weakref.WeakKeyDictionary()


def _timed_forward(model: nn.Module, n_tokens: int) -> float:
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, n_tokens), generator=torch.Generator().manual_seed(0)).to(device)  # [1, T]
    best = float("inf")
    for _ in range(3):  # the fastest of three: a busy core's stall is not the model's cost
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        model(input_ids=ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _fit(model: nn.Module) -> tuple[float, float, int]:
    """(a, b, n): one prompt of L tokens costs about a * L + b * L^2 seconds, fitted to forwards of n / 2 and n
    tokens (n = min(2048, the model's positions): long enough for the quadratic part to show); cached per model."""
    try:
        return _FITS[model]
    except (KeyError, TypeError):
        pass
    n = max(64, min(2048, configured_positions(model) or 2048))
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=next(model.parameters()).device))  # warm-up
        t1, t2 = _timed_forward(model, n // 2), _timed_forward(model, n)
    l1 = n // 2
    b = min(max(0.0, (t2 - 2.0 * t1) / (2.0 * l1 * l1)), t2 / (n * n))  # t = a L + b L^2 through (l1, t1), (n, t2)
    a = min(max(0.0, (t1 - b * l1 * l1) / l1), t2 / n)
    if a == 0.0 and b == 0.0:
        a = t2 / n
    try:
        _FITS[model] = (a, b, n)
    except TypeError:
        pass
    return a, b, n


def prompt_seconds(model: nn.Module, length: int) -> float:
    """About the seconds one prompt of ``length`` tokens takes on ``model`` (its forward; extrapolated from two
    timed forwards, see ``_fit``)."""
    a, b, _ = _fit(model)
    return a * length + b * length * length


def format_seconds(sec: float) -> str:
    """Seconds as "42 s", "3.5 min" or "1.2 h"."""
    if sec < 90:
        return f"{sec:.0f} s"
    if sec < 5400:
        return f"{sec / 60:.1f} min"
    return f"{sec / 3600:.1f} h"


def check_positions(model: nn.Module, evaluation: str, lengths: Iterable[int], prompts_at: Callable[[int], int],
                    *, explicit: bool, log: Callable[[str], None] | None = None) -> list[int]:
    """Say which ``lengths`` exceed the model's configured positions, with an estimate of their time (see the
    module docstring); returns those lengths. ``prompts_at(L)``: the prompts that run at length L; ``explicit``:
    the lengths were asked for (not the suite's multiples of the training length)."""
    positions = configured_positions(model)
    if positions is None or position_limit(model) is not None:  # no declared positions, or they end: skipped rows
        return []
    past = [int(L) for L in lengths if L > positions]
    if not past:
        return []
    far_from = FAR_BEYOND * training_length(model)
    loud = explicit or any(L > far_from for L in past)
    seconds = sum(prompts_at(L) * prompt_seconds(model, L) for L in past)
    n_prompts = sum(prompts_at(L) for L in past)
    _, _, n = _fit(model)
    device = next(model.parameters()).device
    one = len(past) == 1
    what = (f"{evaluation}: length{'' if one else 's'} {', '.join(map(str, past))} exceed{'s' if one else ''} the "
            f"model's {positions} positions (max_position_embeddings)")
    cost = (f"estimated about {format_seconds(seconds)} for {n_prompts} prompt{'' if n_prompts == 1 else 's'} on "
            f"{device.type} (extrapolated from timed {n // 2}- and {n}-token forwards; a prompt's cost grows with "
            "the square of its length)")
    if loud:
        warnings.warn(f"{what}: the model runs there but was not trained there, and slowly: {cost}. To bound it, "
                      f"keep lengths within {positions} (e.g. --set {evaluation}.lengths=[{positions // 2}]) or give "
                      "a time budget (--budget / --time-limit SECONDS; budget_s= / time_limit_s=)",
                      LengthWarning, stacklevel=3)
    elif log is not None:
        log(f"{what}, as the suite's multiples of the training length intend (retrieval past the positions); {cost}")
    return past
