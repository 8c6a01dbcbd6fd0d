"""Metrics of the answer logits: how strongly a run prefers the clean answer.

A metric maps the logits at the answer positions to one number per run. Built-ins are vectorized
over a batch of runs; a user callable ``f(logits_at_answer [A, V], pair) -> float`` is applied per run.

    logit_diff  mean over answer tokens of logit[clean_tok] - logit[corrupt_tok]   (default)
    logprob     sum over answer tokens of log_softmax(logits)[clean_tok]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from headscope.registry import Registry

__all__ = ["Metric", "resolve_metric", "logit_diff", "logprob", "greedy_correct", "METRICS"]


def logit_diff(logits: torch.Tensor, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor) -> torch.Tensor:
    """logits  # [B, A, V]; clean_ids, corrupt_ids  # [A] -> [B] (float64)."""
    logits = logits.double()
    idx_c = clean_ids.to(logits.device).view(1, -1, 1).expand(logits.shape[0], -1, 1)  # [B, A, 1]
    idx_x = corrupt_ids.to(logits.device).view(1, -1, 1).expand(logits.shape[0], -1, 1)  # [B, A, 1]
    diff = logits.gather(-1, idx_c) - logits.gather(-1, idx_x)  # [B, A, 1]
    return diff.squeeze(-1).mean(-1)  # [B]


def logprob(logits: torch.Tensor, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor) -> torch.Tensor:
    """logits  # [B, A, V] -> sum of log-probabilities of the clean answer tokens  # [B] (float64)."""
    logp = torch.log_softmax(logits.double(), dim=-1)  # [B, A, V]
    idx = clean_ids.to(logits.device).view(1, -1, 1).expand(logits.shape[0], -1, 1)  # [B, A, 1]
    return logp.gather(-1, idx).squeeze(-1).sum(-1)  # [B]


# built-in metrics: fn(logits [B, A, V], clean_ids [A], corrupt_ids [A]) -> [B] float64
METRICS: Registry[Callable[..., torch.Tensor]] = Registry("metric", owner="headscope.metrics.METRICS")
METRICS.register("logit_diff", logit_diff)
METRICS.register("logprob", logprob)


def greedy_correct(logits: torch.Tensor, clean_ids: torch.Tensor) -> bool:
    """Teacher-forced greedy exact match: argmax at every answer position is the clean token.

    logits  # [A, V]; clean_ids  # [A]
    """
    return bool((logits.argmax(-1).cpu() == clean_ids.cpu()).all())


@dataclass(frozen=True)
class Metric:
    """A named metric; ``metric(logits [B, A, V], pair) -> [B]`` float64 on the CPU."""

    name: str
    fn: Callable[..., Any]
    builtin: bool

    def __call__(self, logits: torch.Tensor, pair: Any) -> torch.Tensor:
        if logits.dim() == 2:
            logits = logits.unsqueeze(0)  # [1, A, V]
        if self.builtin:
            return self.fn(logits, pair.clean_answer_ids, pair.corrupt_answer_ids).cpu()  # [B]
        user_pair = getattr(pair, "source", None) or pair
        out = [float(self.fn(logits[b], user_pair)) for b in range(logits.shape[0])]
        return torch.tensor(out, dtype=torch.float64)  # [B]


def resolve_metric(metric: "str | Callable | Metric") -> Metric:
    """A metric name ("logit_diff", "logprob"), a callable ``f(logits [A, V], pair) -> float``, or a Metric."""
    if isinstance(metric, Metric):
        return metric
    if isinstance(metric, str):
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; use one of {sorted(METRICS)} or a callable "
                             "f(logits_at_answer [A, V], pair) -> float")
        return Metric(metric, METRICS[metric], builtin=True)
    if callable(metric):
        return Metric(getattr(metric, "__name__", "custom"), metric, builtin=False)
    raise TypeError(f"metric must be a name or a callable, got {type(metric).__name__}")
