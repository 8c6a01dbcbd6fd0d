"""Sender scores by path patching, and iterated path patching (docs/method.md section 1).

    from headscope.senders import sender_scores, iterated_path_patching
    recv = headscope.api.score(model, "niah", tokenizer=tok, n_samples=8)
    send = sender_scores(model, "niah", recv.top(5), tokenizer=tok, n_samples=8)   # HeadScores(kind="sender")
    res = iterated_path_patching(model, "niah", tokenizer=tok, receiver_scores=recv, k=5)
    res.rounds            # [(receivers, HeadScores), ...]
    res.combined          # HeadScores(kind="combined"): fusion.combine(receiver, sender, rule)
    res.to_dataframe()    # one row per head

The definition (exact, per pair) is in headscope/patching/path.py and docs/scoring.md. Use the
same ``n_samples`` / ``seed`` as the receiver scores so that both cover the same pairs. ``n_samples``
follows ``headscope.score``'s rule: None means all pairs of a fixed set (``tasks.from_pairs``); a larger
count than such a task holds is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from headscope.api import prepare_scoring, scoring_settings
from headscope.arch import Arch
from headscope.fusion import COMBINE_RULES, combine
from headscope.heads import Head
from headscope.metrics import resolve_metric
from headscope.patching.engine import receiver_scores as _normalized_scores
from headscope.patching.backends import PATH_BACKENDS, check_path_backend, make_path_backend
from headscope.patching.path import normalize_receivers
from headscope.patching.sharded import is_main_process, resolve_shard, work_share
from headscope.results import HeadScores

__all__ = ["sender_scores", "iterated_path_patching", "PathPatchingResult", "PATH_BACKENDS", "default_k"]

def default_k(n_heads_total: int) -> int:
    """Receivers per round by default: 2% of all heads, at least 1."""
    return max(1, round(0.02 * n_heads_total))


def _prepare(model: Any, task: Any, tokenizer: Any, n_samples: int | None, seed: int, device: Any,
             task_config: dict | None, task_kwargs: dict) -> tuple[nn.Module, Arch, list, list, str]:
    """(hf model, arch, raw pairs, patch pairs, task name), read as headscope.api.score reads them."""
    _, hf, arch, raw, pairs, name = prepare_scoring(model, task, tokenizer, n_samples, seed, device, task_config,
                                                    task_kwargs)
    return hf, arch, raw, pairs, name


def _score_senders(hf: nn.Module, arch: Arch, pairs: list, receivers: Sequence[Head], metric, backend: str,
                   batch_size: int | None, progress: bool, task: str, on_clean_failure: str,
                   min_clean_accuracy: float, settings: dict, shard: str | None = None) -> HeadScores:
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
    engine = make_path_backend(hf, receivers, backend, batch_size)
    bar = None
    if progress and is_main_process():
        from tqdm.auto import tqdm
        sharding = resolve_shard(shard, len(pairs))  # rank 0's share (pairs the clean check drops still count)
        mine, heads = work_share(sharding, len(pairs), arch.n_layers, arch.n_heads)
        total = len(mine) * (arch.n_total if heads is None else len(heads))
        where = "" if sharding is None else f", rank 0 of {sharding.world}"
        bar = tqdm(total=total, desc=f"sender scores ({backend}, {task}, {len(receivers)} receivers{where})",
                   unit="sender")

    class _WithBar:  # the engine normalizes; our bar counts senders (under sharding: rank 0's, a share)
        name, n_layers, n_heads, n_kv_heads = engine.name, engine.n_layers, engine.n_heads, engine.n_kv_heads
        answer_logits = staticmethod(engine.answer_logits)

        @staticmethod
        def patched_metrics(pair, metric, pbar=None, heads=None):
            return engine.patched_metrics(pair, metric, bar, heads=heads)

    last = max(r.layer for r in receivers)
    info = dict(settings)
    info.update(receivers=[r.to_list() for r in receivers], path_backend=backend,
                unreachable_from_layer=last,
                unreachable_note=f"senders at layers >= {last} (the last receiver layer) cannot reach a receiver's "
                                 "input: their score is exactly 0 and was not computed")
    try:
        out = _normalized_scores(_WithBar(), pairs, metric, task=task, progress=False,
                                 on_clean_failure=on_clean_failure, min_clean_accuracy=min_clean_accuracy,
                                 settings=info, shard=shard)
    finally:
        if bar is not None:
            bar.close()
    out.per_sample_raw[:, last:] = 0.0  # exact zeros (M_path was M_clean up to rounding)
    out.kind = "sender"
    return out


def sender_scores(model: Any, task: Any, receivers: Any, *, tokenizer: Any = None, n_samples: int | None = 8,
                  seed: int = 0, metric: "str | Callable" = "logit_diff", backend: str = "hf",
                  batch_size: int | None = None, device: "str | torch.device | None" = None, progress: bool = True,
                  on_clean_failure: str = "warn", min_clean_accuracy: float = 0.5, task_config: dict | None = None,
                  shard: str | None = None, **task_kwargs) -> HeadScores:
    """Sender score of every head through ``receivers`` (docs/method.md section 1) on ``n_samples`` pairs.

    task: a registered name ("niah", ...), a Task object, or a list of TokenizedPair (as in ``score``).
    receivers: heads (Head or (layer, head)), e.g. ``receiver_scores.top(5)``.
    backend: "hf" (fast, exact) or "naive" (the plain reference loop). Returns HeadScores(kind="sender")
    with the raw per-sample scores [N, L, H]; senders at layers >= the last receiver layer are 0.
    shard: split the work over torch.distributed's processes, as in ``score``.
    """
    check_path_backend(backend)
    hf, arch, _, pairs, name = _prepare(model, task, tokenizer, n_samples, seed, device, task_config, task_kwargs)
    heads = normalize_receivers(receivers, arch.n_layers, arch.n_heads)
    settings = scoring_settings(hf, arch, pairs, seed, batch_size, task_config, task_kwargs)
    return _score_senders(hf, arch, pairs, heads, resolve_metric(metric), backend, batch_size, progress, name,
                          on_clean_failure, min_clean_accuracy, settings, shard)


# ---- iterated path patching ------------------------------------------------------------------------
@dataclass
class PathPatchingResult:
    """Every round of iterated path patching, and one combined score per head."""

    receiver: HeadScores  # the receiver scores that picked round 1's receivers
    rounds: list[tuple[tuple[Head, ...], HeadScores]]  # (receivers, sender scores) per round
    converged: bool
    combined: HeadScores  # fusion.combine(receiver, sender = max over rounds, rule)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def sender(self) -> HeadScores:
        """Per-sample sender score of each head: the maximum over rounds."""
        return _max_over_rounds([s for _, s in self.rounds])

    def found(self) -> list[Head]:
        """Every head that was a receiver in some round (round order, then layer/head)."""
        seen: list[Head] = []
        for heads, _ in self.rounds:
            seen += [h for h in heads if h not in seen]
        return seen

    def to_dataframe(self):
        """One row per head: receiver, sender_round{i}, sender (max), combined, rank, receiver_round."""
        import pandas as pd

        first_round = {}
        for i, (heads, _) in enumerate(self.rounds, start=1):
            for h in heads:
                first_round.setdefault(h, i)
        rank = {h: r for r, h in enumerate(self.combined.ranking(), start=1)}
        sender = self.sender.scores  # [L, H]
        rows = []
        for l in range(self.combined.n_layers):
            for h in range(self.combined.n_heads):
                head = Head(l, h)
                row = {"task": self.combined.task, "layer": l, "head": h,
                       "receiver": float(self.receiver.scores[l, h])}
                for i, (_, s) in enumerate(self.rounds, start=1):
                    row[f"sender_round{i}"] = float(s.scores[l, h])
                row.update(sender=float(sender[l, h]), combined=float(self.combined.scores[l, h]), rank=rank[head],
                           receiver_round=first_round.get(head))
                rows.append(row)
        df = pd.DataFrame(rows)
        df["receiver_round"] = df["receiver_round"].astype("Int64")  # <NA>: never a receiver
        return df


def _max_over_rounds(rounds: Sequence[HeadScores]) -> HeadScores:
    first = rounds[0]
    if any(s.per_sample_raw.shape != first.per_sample_raw.shape for s in rounds):
        per_sample = torch.stack([s.raw for s in rounds]).amax(0)[None]  # [1, L, H]: rounds kept different pairs
    else:
        per_sample = torch.stack([s.per_sample_raw for s in rounds]).amax(0)  # [N, L, H]
    return HeadScores(task=first.task, per_sample_raw=per_sample, kind="sender", n_kv_heads=first.n_kv_heads,
                      settings={"rounds": len(rounds), "reduce": "max over rounds of the raw per-sample scores"})


def iterated_path_patching(model: Any, task: Any = "niah", *, tokenizer: Any = None,
                           receiver_scores: HeadScores | None = None, k: int | None = None, max_rounds: int = 3,
                           min_score: float = 0.0, rule: str = "max", weight: float = 0.5, n_samples: int | None = 8,
                           seed: int = 0, metric: "str | Callable" = "logit_diff", backend: str = "hf",
                           batch_size: int | None = None, device: "str | torch.device | None" = None,
                           progress: bool = True, on_clean_failure: str = "warn", min_clean_accuracy: float = 0.5,
                           task_config: dict | None = None, shard: str | None = None,
                           **task_kwargs) -> PathPatchingResult:
    """Iterated path patching: round 1's receivers are the top-k heads by receiver score; round r+1's
    are the top-k senders of round r (clipped mean score > ``min_score``).

    Stops at ``max_rounds`` or when converged: the next receiver set is empty or holds no head that
    was not already a receiver (in particular when the top set stops changing). ``receiver_scores``:
    computed with ``headscope.api.score`` on the same pairs if None. ``k``: default 2% of all heads
    (at least 1). ``rule``/``weight``: how ``fusion.combine`` merges the receiver score with the sender
    score (the maximum over rounds) into ``combined``. ``shard``: split every round (and the receiver
    scores, when computed here) over torch.distributed's processes, as in ``score``.
    """
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"max_rounds must be an int >= 1, got {max_rounds!r}")
    if rule not in COMBINE_RULES:
        raise ValueError(f"rule={rule!r} is not one of {COMBINE_RULES}")
    if not 0.0 <= min_score < 1.0:
        raise ValueError(f"min_score={min_score} must be in [0, 1): it is compared with clipped mean scores")
    check_path_backend(backend)
    hf, arch, raw, pairs, name = _prepare(model, task, tokenizer, n_samples, seed, device, task_config, task_kwargs)
    if k is None:
        k = default_k(arch.n_total)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= arch.n_total:
        raise ValueError(f"k={k!r} must be an int in 1..{arch.n_total} (receivers per round)")
    metric_fn = resolve_metric(metric)
    if receiver_scores is None:
        from headscope.api import score
        from headscope.patching.backends import BACKENDS

        receiver_scores = score(hf, raw, metric=metric_fn, backend=backend if backend in BACKENDS else "auto",
                                batch_size=batch_size, progress=progress, on_clean_failure=on_clean_failure,
                                min_clean_accuracy=min_clean_accuracy, shard=shard)
    if not isinstance(receiver_scores, HeadScores):
        raise TypeError(f"receiver_scores must be HeadScores (headscope.api.score), got "
                        f"{type(receiver_scores).__name__}")
    if (receiver_scores.n_layers, receiver_scores.n_heads) != (arch.n_layers, arch.n_heads):
        raise ValueError(f"receiver_scores are {receiver_scores.n_layers}x{receiver_scores.n_heads} but the model has "
                         f"{arch.n_layers}x{arch.n_heads} heads: score the same model")
    settings = scoring_settings(hf, arch, pairs, seed, batch_size, task_config, task_kwargs)

    rounds: list[tuple[tuple[Head, ...], HeadScores]] = []
    seen: set[Head] = set()
    receivers = tuple(sorted(receiver_scores.top(k)))
    converged = False
    for r in range(1, max_rounds + 1):
        send = _score_senders(hf, arch, pairs, receivers, metric_fn, backend, batch_size, progress, name,
                              on_clean_failure, min_clean_accuracy, {**settings, "round": r}, shard)
        rounds.append((receivers, send))
        seen |= set(receivers)
        top = [h for h in send.top(k) if send[h] > min_score]
        nxt = tuple(sorted(top))
        if not nxt or set(nxt) <= seen:
            converged = True
            break
        receivers = nxt
    sender = _max_over_rounds([s for _, s in rounds])
    combined = combine(receiver_scores, sender, rule=rule, weight=weight)
    combined.settings.update(path_patching={"k": k, "max_rounds": max_rounds, "min_score": min_score,
                                            "n_rounds": len(rounds), "converged": converged,
                                            "receivers": [[h.to_list() for h in hs] for hs, _ in rounds]})
    info = {**settings, "k": k, "max_rounds": max_rounds, "min_score": min_score, "rule": rule, "backend": backend,
            "convergence": "stop when the next receiver set (top-k senders with clipped mean > min_score) is "
                           "empty or contains no head not already used as a receiver"}
    return PathPatchingResult(receiver=receiver_scores, rounds=rounds, converged=converged, combined=combined,
                              settings=info)
