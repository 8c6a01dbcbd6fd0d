"""Turn per-sample head scores into one ranking: stability weighting, receiver+sender, tasks.

    w = stability_weight(niah)                      # [L, H], frac-weighted mean of clipped scores
    both = combine(receiver, sender, rule="max")    # HeadScores(kind="combined")
    fused = fuse({"niah": niah, "reasoning": reasoning})   # HeadScores(kind="fused")

Formulas (also in docs/analysis.md). For head h with clipped per-sample scores s_n(h) in [0, 1],
n = 1..N, mean m(h) and (population) standard deviation sd(h):
- "frac": w(h) = m(h) * f(h), f(h) = #{n : s_n(h) > threshold} / N   (threshold 0.1 by default)
- "snr":  w(h) = m(h) * min(1, snr(h) / c), snr(h) = m(h) / (sd(h) + eps)   (c = 2 by default)
- "none": w(h) = m(h)
Both weights are <= m(h): a head that matters on only a few samples is pushed down.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from headscope.results import HeadScores

__all__ = ["stability_weight", "combine", "fuse", "STABILITY_METHODS", "COMBINE_RULES", "DEFAULT_THRESHOLD",
           "DEFAULT_SNR_C"]

STABILITY_METHODS = ("frac", "snr", "none")
COMBINE_RULES = ("max", "mean", "receiver", "weighted")
NORMALIZE_MODES = ("none", "max", "sum")
DEFAULT_THRESHOLD = 0.1  # a head "is important" on a sample when its clipped score exceeds this
DEFAULT_SNR_C = 2.0  # snr at which the snr weight saturates to 1
_EPS = 1e-8


def stability_weight(scores: HeadScores, method: str = "frac", threshold: float = DEFAULT_THRESHOLD,
                     c: float = DEFAULT_SNR_C) -> torch.Tensor:
    """Stability-weighted score of every head, ``[L, H]`` (see the module docstring for formulas).

    ``method``: "frac" (mean x fraction of samples where the clipped score > ``threshold``),
    "snr" (mean x min(1, (mean / (std + 1e-8)) / ``c``)) or "none" (the plain mean).
    """
    if not isinstance(scores, HeadScores):
        raise TypeError(f"stability_weight: expected HeadScores, got {type(scores).__name__}")
    if method not in STABILITY_METHODS:
        raise ValueError(f"stability_weight: method={method!r} is not one of {STABILITY_METHODS}")
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"stability_weight: threshold={threshold} must be in [0, 1)")
    if c <= 0:
        raise ValueError(f"stability_weight: c={c} must be > 0")
    s = scores.per_sample  # [N, L, H] clipped to [0, 1]
    mean = s.mean(0)  # [L, H]
    if method == "none":
        return mean
    if method == "frac":
        frac = (s > threshold).double().mean(0)  # [L, H]
        return mean * frac
    sd = s.std(0, unbiased=False)  # [L, H]
    snr = mean / (sd + _EPS)  # [L, H]
    return mean * (snr / c).clamp(max=1.0)


def _as_float(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else torch.as_tensor(x)


def combine(receiver: HeadScores, sender: HeadScores | None = None, rule: str = "max",
            weight: float = 0.5) -> HeadScores:
    """One score per head from its receiver and sender scores: ``HeadScores(kind="combined")``.

    ``rule`` (default "max": a head matters if it matters either as a receiver or as a sender):
    - "max":      s = max(s_recv, s_send)
    - "mean":     s = (s_recv + s_send) / 2
    - "weighted": s = (1 - weight) * s_recv + weight * s_send
    - "receiver": s = s_recv (the sender scores are ignored)
    applied to the raw per-sample scores when both cover the same samples (so stability weighting
    still sees per-sample scores), else to the sample means (stored as one sample). Sender entries
    that are NaN (heads not scored as senders) take the receiver score.
    """
    if rule not in COMBINE_RULES:
        raise ValueError(f"combine: rule={rule!r} is not one of {COMBINE_RULES}")
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"combine: weight={weight} must be in [0, 1]")
    if not isinstance(receiver, HeadScores):
        raise TypeError(f"combine: receiver must be HeadScores, got {type(receiver).__name__}")
    settings = {"rule": rule, "weight": weight if rule == "weighted" else None, "receiver_kind": receiver.kind,
                "sender_kind": None if sender is None else sender.kind, "receiver_settings": receiver.settings}
    r = receiver.per_sample_raw  # [N, L, H]
    if sender is None or rule == "receiver":
        out = r.clone()
    else:
        if (sender.n_layers, sender.n_heads) != (receiver.n_layers, receiver.n_heads):
            raise ValueError(f"combine: receiver scores are {receiver.n_layers}x{receiver.n_heads} but sender scores "
                             f"are {sender.n_layers}x{sender.n_heads}; score both on the same model")
        s = sender.per_sample_raw  # [N', L, H]
        if s.shape[0] != r.shape[0]:
            r = r.nanmean(0, keepdim=True)  # [1, L, H]
            s = s.nanmean(0, keepdim=True)  # [1, L, H]
            settings["per_sample"] = False
        s = torch.where(torch.isnan(s), r, s)
        if rule == "max":
            out = torch.maximum(r, s)
        elif rule == "mean":
            out = (r + s) / 2
        else:
            out = (1 - weight) * r + weight * s
        settings["sender_settings"] = sender.settings
    same_samples = out.shape[0] == receiver.n_samples
    return HeadScores(task=receiver.task, per_sample_raw=out, kind="combined",
                      n_kv_heads=receiver.n_kv_heads or (sender.n_kv_heads if sender is not None else None),
                      clean_metric=_as_float(receiver.clean_metric) if same_samples else None,
                      corrupt_metric=_as_float(receiver.corrupt_metric) if same_samples else None,
                      clean_correct=receiver.clean_correct if same_samples else None,
                      settings=settings)


def _by_task(scores_by_task: Mapping[str, HeadScores] | Sequence[HeadScores]) -> dict[str, HeadScores]:
    if isinstance(scores_by_task, HeadScores):
        scores_by_task = [scores_by_task]
    if isinstance(scores_by_task, Mapping):
        items = list(scores_by_task.items())
    else:
        items, seen = [], {}
        for s in scores_by_task:
            name = getattr(s, "task", "?")
            seen[name] = seen.get(name, 0) + 1
            items.append((name if seen[name] == 1 else f"{name}#{seen[name]}", s))
    if not items:
        raise ValueError("fuse: no scores given; pass {task: HeadScores} or a list of HeadScores")
    for name, s in items:
        if not isinstance(s, HeadScores):
            raise TypeError(f"fuse: scores for task {name!r} are {type(s).__name__}, expected HeadScores")
    shapes = {name: (s.n_layers, s.n_heads) for name, s in items}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"fuse: tasks were scored on differently shaped models (layers x heads): {shapes}; "
                         "fuse only scores of one model")
    return dict(items)


def fuse(scores_by_task: Mapping[str, HeadScores] | Sequence[HeadScores],
         weights: Mapping[str, float] | Sequence[float] | None = None,
         stability: str = "frac", threshold: float = DEFAULT_THRESHOLD, c: float = DEFAULT_SNR_C,
         normalize: str = "none") -> HeadScores:
    """Fuse tasks into one score per head: S(h) = sum_t a_t * norm(w_t(h)) / sum_t a_t.

    ``w_t`` is task t's ``stability_weight`` (method ``stability``); ``a_t`` the task weights (equal
    by default; a dict by task name or a list in task order; must be >= 0 with a positive sum).
    ``normalize`` (default "none": receiver scores are already fractions of each task's full effect,
    so they share a scale) can be "max" (divide each task's map by its maximum, so every task's best
    head counts 1) or "sum" (divide by its total). The result is ``HeadScores(kind="fused")`` whose
    single "sample" is the fused ``[L, H]`` map (per-sample spread is not meaningful after fusion);
    ``settings["per_task"]`` keeps each task's weighted map.
    """
    tasks = _by_task(scores_by_task)
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"fuse: normalize={normalize!r} is not one of {NORMALIZE_MODES}")
    names = list(tasks)
    if weights is None:
        a = {t: 1.0 for t in names}
    elif isinstance(weights, Mapping):
        missing = [t for t in names if t not in weights]
        extra = [t for t in weights if t not in tasks]
        if missing or extra:
            raise ValueError(f"fuse: weights must name exactly the tasks {names}; missing {missing}, unknown {extra}")
        a = {t: float(weights[t]) for t in names}
    else:
        weights = list(weights)
        if len(weights) != len(names):
            raise ValueError(f"fuse: got {len(weights)} weights for {len(names)} tasks {names}")
        a = {t: float(w) for t, w in zip(names, weights)}
    if any(w < 0 for w in a.values()) or sum(a.values()) <= 0:
        raise ValueError(f"fuse: task weights must be >= 0 with a positive sum, got {a}")
    kv = {s.n_kv_heads for s in tasks.values() if s.n_kv_heads is not None}
    if len(kv) > 1:
        raise ValueError(f"fuse: tasks disagree on n_kv_heads ({sorted(kv)}); fuse only scores of one model")

    per_task: dict[str, torch.Tensor] = {}
    for t, s in tasks.items():
        w = stability_weight(s, stability, threshold, c)  # [L, H]
        if normalize == "max" and w.max() > 0:
            w = w / w.max()
        elif normalize == "sum" and w.sum() > 0:
            w = w / w.sum()
        per_task[t] = w
    total = sum(a.values())
    fused = sum(a[t] * per_task[t] for t in names) / total  # [L, H]
    settings = {"tasks": names, "weights": a, "stability": stability, "threshold": threshold, "c": c,
                "normalize": normalize, "kinds": {t: s.kind for t, s in tasks.items()},
                "n_samples": {t: s.n_samples for t, s in tasks.items()},
                "per_task": {t: per_task[t].tolist() for t in names}}
    return HeadScores(task="+".join(names), per_sample_raw=fused[None], kind="fused",
                      n_kv_heads=next(iter(kv)) if kv else None, settings=settings)
