"""Turn per-sample head scores into one ranking: stability weighting, receiver+sender, tasks.

    w = stability_weight(niah)                      # [L, H], soft-fraction-weighted mean of clipped scores
    both = combine(receiver, sender, rule="max")    # HeadScores(kind="combined")
    fused = fuse({"niah": niah, "arithmetic": arith, "binding": bind})   # HeadScores(kind="fused")

Formulas (also in docs/scoring.md). For head h with clipped per-sample scores s_n(h) in [0, 1],
n = 1..N, mean m(h) and (population) standard deviation sd(h); tau = ``threshold`` (0.1):
- "frac" (default): w(h) = m(h) * f(h), f(h) = mean_n min(1, s_n(h) / tau)   (a soft fraction)
- "hard_frac":      w(h) = m(h) * #{n : s_n(h) > tau} / N
- "snr":            w(h) = m(h) * min(1, snr(h) / c), snr(h) = m(h) / (sd(h) + eps)   (c = 2)
- "none":           w(h) = m(h)
Every weight is <= m(h): a head that matters on only a few samples is pushed down. These formulas
and thresholds are this project's choices: the paper's summaries say only that a head important in
just a few samples is down-weighted. The soft fraction keeps an order among weak heads (a head with
some signal never gets exactly 0), where the hard fraction gives 0 to every head below tau.

Tasks are fused by CLASS (the paper's two target abilities, retrieval and reasoning, weigh equally):
S(h) = sum_t e_t * norm(w_t(h)) / sum_t e_t with e_t = b_c / n_c for task t of class c (b_c the class
weight, equal by default; n_c the number of tasks of class c). ``DEFAULT_TASK_CLASSES`` maps the
built-in tasks; see ``task_class`` for other names.

Every variant is an entry of a registry (``STABILITY_METHODS``, ``COMBINE_RULES``, ``NORMALIZE_MODES``):
add one with e.g. ``STABILITY_METHODS.register("median", fn)`` and it is usable by name everywhere.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Sequence

import torch

from headscope.registry import Registry
from headscope.results import HeadScores, require_finite

__all__ = ["stability_weight", "combine", "fuse", "task_class", "signal_maps", "STABILITY_METHODS",
           "COMBINE_RULES", "NORMALIZE_MODES", "DEFAULT_TASK_CLASSES", "DEFAULT_THRESHOLD", "DEFAULT_SNR_C",
           "DEFAULT_STABILITY"]

DEFAULT_THRESHOLD = 0.1  # tau: a sample counts fully once the head carries >= 10% of the task's full effect
DEFAULT_SNR_C = 2.0  # snr at which the snr weight saturates to 1
DEFAULT_STABILITY = "frac"
_EPS = 1e-8

# ----------------------------------------------------------------------------- registries

StabilityFn = Callable[..., torch.Tensor]  # (s [N, L, H] clipped, threshold, c) -> [L, H]
STABILITY_METHODS: Registry[StabilityFn] = Registry("stability method", owner="headscope.fusion.STABILITY_METHODS")
# (r, s [N, L, H], weight) -> [L, H]
COMBINE_RULES: Registry[Callable[..., torch.Tensor]] = Registry("combine rule", owner="headscope.fusion.COMBINE_RULES")
# [L, H] -> [L, H]
NORMALIZE_MODES: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("normalize mode",
                                                                              owner="headscope.fusion.NORMALIZE_MODES")

# the formula of each stability method, recorded in the fused settings
STABILITY_FORMULAS = {
    "frac": "m(h) * mean_n min(1, s_n(h) / threshold)",
    "hard_frac": "m(h) * #{n : s_n(h) > threshold} / N",
    "snr": "m(h) * min(1, (m(h) / (sd(h) + 1e-8)) / c)",
    "none": "m(h)",
}


@STABILITY_METHODS.register("frac")
def _soft_frac(s: torch.Tensor, threshold: float, c: float) -> torch.Tensor:
    if threshold <= 0:
        raise ValueError(f"stability_weight: threshold={threshold} must be > 0 for method 'frac' (it divides "
                         "the per-sample scores); use method='none' for the plain mean")
    frac = (s / threshold).clamp(max=1.0).mean(0)  # [L, H] soft fraction of samples where h matters
    return s.mean(0) * frac


@STABILITY_METHODS.register("hard_frac")
def _hard_frac(s: torch.Tensor, threshold: float, c: float) -> torch.Tensor:
    return s.mean(0) * (s > threshold).double().mean(0)  # [L, H]


@STABILITY_METHODS.register("snr")
def _snr(s: torch.Tensor, threshold: float, c: float) -> torch.Tensor:
    mean = s.mean(0)  # [L, H]
    sd = s.std(0, unbiased=False)  # [L, H]
    return mean * (mean / (sd + _EPS) / c).clamp(max=1.0)


@STABILITY_METHODS.register("none")
def _plain_mean(s: torch.Tensor, threshold: float, c: float) -> torch.Tensor:
    return s.mean(0)  # [L, H]


@COMBINE_RULES.register("max")
def _rule_max(r: torch.Tensor, s: torch.Tensor, weight: float) -> torch.Tensor:
    return torch.maximum(r, s)


@COMBINE_RULES.register("mean")
def _rule_mean(r: torch.Tensor, s: torch.Tensor, weight: float) -> torch.Tensor:
    return (r + s) / 2


@COMBINE_RULES.register("receiver")
def _rule_receiver(r: torch.Tensor, s: torch.Tensor, weight: float) -> torch.Tensor:
    return r.clone()


@COMBINE_RULES.register("weighted")
def _rule_weighted(r: torch.Tensor, s: torch.Tensor, weight: float) -> torch.Tensor:
    return (1 - weight) * r + weight * s


@NORMALIZE_MODES.register("none")
def _norm_none(w: torch.Tensor) -> torch.Tensor:
    return w


@NORMALIZE_MODES.register("max")
def _norm_max(w: torch.Tensor) -> torch.Tensor:
    return w / w.max() if w.max() > 0 else w


@NORMALIZE_MODES.register("sum")
def _norm_sum(w: torch.Tensor) -> torch.Tensor:
    return w / w.sum() if w.sum() > 0 else w


# ----------------------------------------------------------------------------- task classes

# The paper's two task classes: retrieval (needle in a haystack) and reasoning (every reasoning family).
DEFAULT_TASK_CLASSES: dict[str, str] = {
    "niah": "retrieval", "niah_multikey": "retrieval",
    "reasoning": "reasoning", "arithmetic": "reasoning", "binding": "reasoning", "comparison": "reasoning",
    "two_hop": "reasoning",
}


def task_class(task: str, classes: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """(class of ``task``, whether a rule knew it). The rules, in order: ``classes`` (yours) then
    ``DEFAULT_TASK_CLASSES``, by the exact name and then by the name without a "#n" suffix (a task
    repeated in a list); a name starting with "niah" is retrieval; any other name is its own class."""
    table = {**DEFAULT_TASK_CLASSES, **dict(classes or {})}
    base = task.split("#", 1)[0]
    for name in (task, base):
        if name in table:
            return str(table[name]), True
    if base.startswith("niah"):
        return "retrieval", True
    return base, False


def _class_weights(names: list[str], classes: Mapping[str, str] | None, class_weights: Mapping[str, float] | None,
                   warn: bool) -> tuple[dict[str, str], dict[str, float]]:
    of, unknown = {}, []
    for t in names:
        of[t], known = task_class(t, classes)
        if not known:
            unknown.append(t)
    if unknown and warn:
        warnings.warn(f"fuse: tasks {unknown} are in no known class, so each counts as its own class (weighing as "
                      "much as all retrieval tasks together); group them with classes={'name': 'retrieval' or "
                      "'reasoning'}", UserWarning, stacklevel=3)
    present = list(dict.fromkeys(of.values()))
    if class_weights is None:
        b = {c: 1.0 for c in present}
    else:
        missing = [c for c in present if c not in class_weights]
        if missing:
            raise ValueError(f"fuse: class_weights gives no weight to the classes {missing} (tasks by class: "
                             f"{_members(of)}); name every class present")
        b = {c: float(class_weights[c]) for c in present}
    return of, b


def _members(of: Mapping[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for t, c in of.items():
        out.setdefault(c, []).append(t)
    return out


# ----------------------------------------------------------------------------- stability

def _check(scores: Any, who: str) -> HeadScores:
    if not isinstance(scores, HeadScores):
        raise TypeError(f"{who}: expected HeadScores, got {type(scores).__name__}")
    return scores


def stability_weight(scores: HeadScores, method: str = DEFAULT_STABILITY, threshold: float = DEFAULT_THRESHOLD,
                     c: float = DEFAULT_SNR_C) -> torch.Tensor:
    """Stability-weighted score of every head, ``[L, H]`` (see the module docstring for the formulas).

    ``method``: any name in ``STABILITY_METHODS`` ("frac", "hard_frac", "snr", "none"); ``threshold``
    is tau of "frac" / "hard_frac", ``c`` the saturation of "snr". Non-finite scores are refused.
    """
    _check(scores, "stability_weight")
    fn = STABILITY_METHODS.entry(method, who="stability_weight: method")
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"stability_weight: threshold={threshold} must be in [0, 1) (scores are clipped to [0, 1])")
    if not c > 0:
        raise ValueError(f"stability_weight: c={c} must be > 0")
    require_finite(scores.per_sample_raw, "stability_weight", f"scores of task {scores.task!r}")
    s = scores.per_sample  # [N, L, H] clipped to [0, 1]
    return fn(s, threshold=threshold, c=c).double()  # [L, H]


# ----------------------------------------------------------------------------- unweighted maps

def _map(x: Any) -> torch.Tensor | None:
    return None if x is None else torch.as_tensor(x, dtype=torch.float64)


def signal_maps(scores: HeadScores) -> dict[str, torch.Tensor]:
    """The unweighted per-head maps behind ``scores`` (each ``[L, H]``, clipped means, >= 0):

    "score" (``scores.scores``: for fused scores the weighted, fused map), "receiver" and "sender"
    (a task's plain mean receiver / sender score; for fused scores the task-weighted average over
    the tasks that have one), and for fused scores "receiver:TASK" / "sender:TASK" per task.
    Selection breaks ties with them and counts heads that carry no signal in any of them.
    """
    _check(scores, "signal_maps")
    out = {"score": scores.scores}
    st = scores.settings or {}
    if scores.kind == "receiver":
        out["receiver"] = scores.scores
    elif scores.kind == "sender":
        out["sender"] = scores.scores
    elif scores.kind == "combined":
        for key in ("receiver", "sender"):
            m = _map(st.get(f"{key}_mean"))
            if m is not None:
                out[key] = m
    elif scores.kind == "fused":
        for key in ("receiver", "sender"):
            m = _map(st.get(f"unweighted_{key}"))
            if m is not None:
                out[key] = m
        for task, maps in (st.get("unweighted") or {}).items():
            for key in ("receiver", "sender"):
                m = _map((maps or {}).get(key))
                if m is not None:
                    out[f"{key}:{task}"] = m
    shape = scores.scores.shape
    return {k: v for k, v in out.items() if tuple(v.shape) == tuple(shape)}


# ----------------------------------------------------------------------------- combine

def combine(receiver: HeadScores, sender: HeadScores | None = None, rule: str = "max",
            weight: float = 0.5) -> HeadScores:
    """One score per head from its receiver and sender scores: ``HeadScores(kind="combined")``.

    ``rule`` (any name in ``COMBINE_RULES``; default "max": a head matters if it matters either as a
    receiver or as a sender):
    - "max":      s = max(s_recv, s_send)
    - "mean":     s = (s_recv + s_send) / 2
    - "weighted": s = (1 - weight) * s_recv + weight * s_send
    - "receiver": s = s_recv (the sender scores are ignored)
    applied to the raw per-sample scores when both cover the same samples (so stability weighting
    still sees per-sample scores), else to the sample means (stored as one sample). Sender entries
    that are NaN mean "not scored as a sender" and take the receiver score; any other non-finite
    score (NaN receiver scores, infinite scores) is refused. ``settings["receiver_mean"]`` and
    ``settings["sender_mean"]`` keep the plain (unweighted, clipped) mean maps for selection.
    """
    fn = COMBINE_RULES.entry(rule, who="combine: rule")
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"combine: weight={weight} must be in [0, 1]")
    if not isinstance(receiver, HeadScores):
        raise TypeError(f"combine: receiver must be HeadScores, got {type(receiver).__name__}")
    if sender is not None and not isinstance(sender, HeadScores):
        raise TypeError(f"combine: sender must be HeadScores or None, got {type(sender).__name__}")
    require_finite(receiver.per_sample_raw, "combine", f"receiver scores of task {receiver.task!r}")
    recv_maps = signal_maps(receiver)
    settings: dict[str, Any] = {
        "rule": rule, "weight": weight if rule == "weighted" else None, "receiver_kind": receiver.kind,
        "sender_kind": None if sender is None else sender.kind, "receiver_settings": receiver.settings,
        "receiver_mean": recv_maps.get("receiver", receiver.scores).tolist()}
    r = receiver.per_sample_raw  # [N, L, H]
    if sender is None:
        out = r.clone()
    else:
        if (sender.n_layers, sender.n_heads) != (receiver.n_layers, receiver.n_heads):
            raise ValueError(f"combine: receiver scores are {receiver.n_layers}x{receiver.n_heads} but sender scores "
                             f"are {sender.n_layers}x{sender.n_heads}; score both on the same model")
        require_finite(sender.per_sample_raw, "combine", f"sender scores of task {sender.task!r}", allow_nan=True)
        s = sender.per_sample_raw  # [N', L, H]
        sender_mean = s.clamp(0.0, 1.0).nanmean(0).nan_to_num(0.0)  # [L, H]; never scored: 0
        settings["sender_mean"] = sender_mean.tolist()
        settings["n_sender_not_scored"] = int(torch.isnan(s).all(0).sum())
        if rule == "receiver":
            s = r
        elif s.shape[0] != r.shape[0]:
            r = r.nanmean(0, keepdim=True)  # [1, L, H]
            s = s.nanmean(0, keepdim=True)  # [1, L, H]
            settings["per_sample"] = False
        s = torch.where(torch.isnan(s), r, s)
        out = fn(r, s, weight)  # [N, L, H]
        settings["sender_settings"] = sender.settings
    same_samples = out.shape[0] == receiver.n_samples
    return HeadScores(task=receiver.task, per_sample_raw=out, kind="combined",
                      n_kv_heads=receiver.n_kv_heads or (sender.n_kv_heads if sender is not None else None),
                      clean_metric=receiver.clean_metric if same_samples else None,
                      corrupt_metric=receiver.corrupt_metric if same_samples else None,
                      clean_correct=receiver.clean_correct if same_samples else None,
                      settings=settings)


# ----------------------------------------------------------------------------- fuse

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
        require_finite(s.per_sample_raw, "fuse", f"scores of task {name!r}")
    shapes = {name: (s.n_layers, s.n_heads) for name, s in items}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"fuse: tasks were scored on differently shaped models (layers x heads): {shapes}; "
                         "fuse only scores of one model")
    return dict(items)


def _task_weights(names: list[str], weights: Mapping[str, float] | Sequence[float]) -> dict[str, float]:
    if isinstance(weights, Mapping):
        missing = [t for t in names if t not in weights]
        extra = [t for t in weights if t not in names]
        if missing or extra:
            raise ValueError(f"fuse: weights must name exactly the tasks {names}; missing {missing}, unknown {extra}")
        a = {t: float(weights[t]) for t in names}
    else:
        weights = list(weights)
        if len(weights) != len(names):
            raise ValueError(f"fuse: got {len(weights)} weights for {len(names)} tasks {names}")
        a = {t: float(w) for t, w in zip(names, weights)}
    return a


def _weighted_mean(maps: dict[str, torch.Tensor | None], e: Mapping[str, float]) -> torch.Tensor | None:
    have = [t for t, m in maps.items() if m is not None and e[t] > 0]
    if not have:
        return None
    total = sum(e[t] for t in have)
    return sum(e[t] * maps[t] for t in have) / total  # [L, H]


def fuse(scores_by_task: Mapping[str, HeadScores] | Sequence[HeadScores],
         weights: Mapping[str, float] | Sequence[float] | None = None,
         stability: str = DEFAULT_STABILITY, threshold: float = DEFAULT_THRESHOLD, c: float = DEFAULT_SNR_C,
         normalize: str = "none", *, classes: Mapping[str, str] | None = None,
         class_weights: Mapping[str, float] | None = None) -> HeadScores:
    """Fuse tasks into one score per head: S(h) = sum_t e_t * norm(w_t(h)) / sum_t e_t.

    ``w_t`` is task t's ``stability_weight`` (method ``stability``). The task weights e_t come from the
    task CLASSES by default: e_t = b_c / n_c for a task of class c, so that the classes (retrieval,
    reasoning) weigh equally however many tasks each has (``class_weights`` {class: b_c} changes
    that; ``classes`` {task: class} adds or overrides entries of ``DEFAULT_TASK_CLASSES``; see
    ``task_class`` for names in no class). ``weights`` (a dict by task name or a list in task order)
    sets e_t directly instead and ignores the classes; give it or ``class_weights``, not both. All
    weights must be >= 0 with a positive sum.

    ``normalize`` (any name in ``NORMALIZE_MODES``; default "none": receiver scores are already
    fractions of each task's full effect, so they share a scale) can be "max" (divide each task's map
    by its maximum) or "sum" (by its total). The result is ``HeadScores(kind="fused")`` whose single
    "sample" is the fused ``[L, H]`` map. Its settings keep the class structure ("classes",
    "task_class", "class_weights", "weights" = the e_t used, normalized to sum 1), each task's weighted
    map ("per_task") and each task's unweighted receiver / sender maps ("unweighted", and their
    e_t-weighted averages "unweighted_receiver" / "unweighted_sender") for ``select``.
    """
    tasks = _by_task(scores_by_task)
    norm = NORMALIZE_MODES.entry(normalize, who="fuse: normalize")
    STABILITY_METHODS.entry(stability, who="fuse: stability")
    names = list(tasks)
    of, b = _class_weights(names, classes, class_weights, warn=weights is None)
    if weights is not None:
        if class_weights is not None:
            raise ValueError("fuse: give task weights (weights=) or class weights (class_weights=), not both")
        e = _task_weights(names, weights)
        source = "task weights"
        if any(w < 0 for w in e.values()) or sum(e.values()) <= 0:
            raise ValueError(f"fuse: task weights must be >= 0 with a positive sum, got {e}")
    else:
        if any(w < 0 for w in b.values()) or sum(b.values()) <= 0:
            raise ValueError(f"fuse: class weights must be >= 0 with a positive sum, got {b}")
        members = _members(of)
        e = {t: b[of[t]] / len(members[of[t]]) for t in names}
        source = "classes"
    kv = {s.n_kv_heads for s in tasks.values() if s.n_kv_heads is not None}
    if len(kv) > 1:
        raise ValueError(f"fuse: tasks disagree on n_kv_heads ({sorted(kv)}); fuse only scores of one model")

    per_task: dict[str, torch.Tensor] = {}
    recv: dict[str, torch.Tensor | None] = {}
    send: dict[str, torch.Tensor | None] = {}
    for t, s in tasks.items():
        per_task[t] = norm(stability_weight(s, stability, threshold, c))  # [L, H]
        maps = signal_maps(s)
        recv[t], send[t] = maps.get("receiver"), maps.get("sender")
    total = sum(e.values())
    fused = sum(e[t] * per_task[t] for t in names) / total  # [L, H]
    r_mean, s_mean = _weighted_mean(recv, e), _weighted_mean(send, e)
    settings = {"tasks": names, "weights": {t: e[t] / total for t in names}, "weights_from": source,
                "classes": _members(of), "task_class": of, "class_weights": b if source == "classes" else None,
                "stability": stability, "stability_formula": STABILITY_FORMULAS.get(stability, "registered"),
                "threshold": threshold, "c": c, "normalize": normalize,
                "kinds": {t: s.kind for t, s in tasks.items()},
                "n_samples": {t: s.n_samples for t, s in tasks.items()},
                "per_task": {t: per_task[t].tolist() for t in names},
                "unweighted": {t: {"receiver": None if recv[t] is None else recv[t].tolist(),
                                   "sender": None if send[t] is None else send[t].tolist()} for t in names},
                "unweighted_receiver": None if r_mean is None else r_mean.tolist(),
                "unweighted_sender": None if s_mean is None else s_mean.tolist()}
    return HeadScores(task="+".join(names), per_sample_raw=fused[None], kind="fused",
                      n_kv_heads=next(iter(kv)) if kv else None, settings=settings)
