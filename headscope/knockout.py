"""Knockout curves: ablate the top-k heads by score, and as many random heads, and watch accuracy.

    df = knockout_curve(model, "niah", scores)     # rows: k, fraction, selection, ...
    auc(df)                                        # {"top": ..., "random": ..., "gap": ...}
    knockout_eval(model, "niah", [Head(3, 1)])     # one head set

The pairs come from ``headscope.pairs.task_pairs`` (a task name, a Task or a list of TokenizedPair; the
tokenizer is found from the model unless ``tokenizer=`` is given). A knocked-out head's output (its
slice of the output projection's input) is replaced, through ``headscope.ablation.ablate_heads``, by:
"patch" (the default, as in the paper) its value on the pair's corrupted prompt (run alongside), "mean"
its mean over the evaluation prompts (clean and corrupt), or "zero" zeros.
Accuracy is teacher-forced greedy exact match on the clean answer; ``metric`` (``headscope.metrics``,
default the clean-minus-corrupt answer logit difference) is averaged over pairs.

``n_samples`` (default 16) follows the rule of ``headscope.score``: None means all pairs of a task with a
fixed set (``headscope.tasks.from_pairs``, a list of TokenizedPair); a count larger than such a task holds
is refused, saying how many pairs there are and suggesting ``n_samples=None``; a generated task needs a count.
"""
from __future__ import annotations

import random
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn as nn

from headscope.ablation import ABLATION_KINDS, ablate_heads, head_means
from headscope.arch import describe
from headscope.heads import Head
from headscope.hooks import record_inputs
from headscope.metrics import resolve_metric
from headscope.pairs import task_name, task_pairs
from headscope.results import HeadScores
from headscope.tasks.base import resolve_n_samples
from headscope.tokenizers import find_tokenizer

__all__ = ["knockout_curve", "knockout_eval", "auc", "default_ks", "KNOCKOUT_KIND"]

KNOCKOUT_KIND = "patch"  # the paper's: a knocked-out head takes its activation from the corrupted prompt


def _pad(seqs: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros(len(seqs), T, dtype=torch.long)  # [B, T]
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[b, :len(s)] = 1
    return ids, mask


def _batches(pairs: Sequence, batch_size: int,
             pad_id: int) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(indices, clean ids [B, T], corrupt ids [B, T], mask [B, T]), similar lengths together."""
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i].clean_ids))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        clean, mask = _pad([pairs[i].clean_ids for i in idx], pad_id)
        corrupt, _ = _pad([pairs[i].corrupt_ids for i in idx], pad_id)
        yield idx, clean, corrupt, mask


def _mean_values(model: nn.Module, pairs: Sequence, batch_size: int, pad_id: int) -> torch.Tensor:
    batches = []
    for _, clean, corrupt, mask in _batches(pairs, batch_size, pad_id):
        batches += [{"input_ids": clean, "attention_mask": mask}, {"input_ids": corrupt, "attention_mask": mask}]
    return head_means(model, batches)  # [L, H, D]


@torch.no_grad()
def _evaluate(model: nn.Module, pairs: Sequence, heads: list[Head], kind: str, metric: Any, batch_size: int,
              pad_id: int, means: torch.Tensor | None) -> tuple[float, float]:
    """(accuracy, mean metric) of the clean runs with ``heads`` knocked out."""
    from headscope.evaluate.engine import exact_match  # the evaluation harness's definition of accuracy

    arch = describe(model)
    device = next(model.parameters()).device
    correct, values = [], []
    for idx, clean, corrupt, mask in _batches(pairs, batch_size, pad_id):
        clean, corrupt, mask = clean.to(device), corrupt.to(device), mask.to(device)
        patch = None
        if heads and kind == "patch":
            with record_inputs({h.layer: arch.out_projs[h.layer] for h in heads}) as store:
                model(input_ids=corrupt, attention_mask=mask)
            patch = {h: store[h.layer][..., arch.head_slice(h.head)] for h in heads}  # each [B, T, D]
        if heads:
            with ablate_heads(model, heads, kind=kind, values=patch if kind == "patch" else means):
                logits = model(input_ids=clean, attention_mask=mask).logits  # [B, T, V]
        else:
            logits = model(input_ids=clean, attention_mask=mask).logits  # [B, T, V]
        for b, i in enumerate(idx):
            p = pairs[i]
            at = logits[b, torch.as_tensor(p.answer_pos, device=device)]  # [A, V]
            correct.append(exact_match(at, p))
            values.append(float(metric(at, p)[0]))
    return float(np.mean(correct)), float(np.mean(values))


def _check_common(kind: str, batch_size: int) -> None:
    if kind not in ABLATION_KINDS:
        raise ValueError(f"kind={kind!r} is not one of {ABLATION_KINDS}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")


def _pad_id(tokenizer: Any) -> int:
    pid = getattr(tokenizer, "pad_token_id", None)
    return 0 if pid is None else int(pid)


def _pairs_and_pad(model: nn.Module, task: Any, tokenizer: Any, n_samples: int | None, seed: int,
                   task_kwargs: dict) -> tuple[list, int]:
    n_samples = resolve_n_samples(task, n_samples, model=model, task_options=task_kwargs, who="knockout")
    pairs = task_pairs(model, task, tokenizer=tokenizer, n_samples=n_samples, seed=seed, **task_kwargs)
    return pairs, _pad_id(find_tokenizer(model, tokenizer, required=False))


def knockout_eval(model: nn.Module, task: Any, heads: Sequence, *, tokenizer: Any = None, kind: str = KNOCKOUT_KIND,
                  n_samples: int | None = 16, seed: int = 0, metric: Any = "logit_diff", batch_size: int = 8,
                  **task_kwargs) -> dict[str, float]:
    """Accuracy and mean metric with ``heads`` knocked out, and without (``*_clean``)."""
    _check_common(kind, batch_size)
    arch = describe(model)
    heads = sorted({Head.from_any(h) for h in heads})
    bad = [str(h) for h in heads if h.layer >= arch.n_layers or h.head >= arch.n_heads]
    if bad:
        raise ValueError(f"knockout_eval: heads {bad} are outside the model ({arch.n_layers} x {arch.n_heads})")
    pairs, pad = _pairs_and_pad(model, task, tokenizer, n_samples, seed, task_kwargs)
    m = resolve_metric(metric)
    means = _mean_values(model, pairs, batch_size, pad) if kind == "mean" and heads else None
    acc0, met0 = _evaluate(model, pairs, [], kind, m, batch_size, pad, None)
    acc, met = _evaluate(model, pairs, heads, kind, m, batch_size, pad, means)
    return {"n_heads": len(heads), "accuracy": acc, "metric": met, "accuracy_clean": acc0, "metric_clean": met0}


def default_ks(n_total: int, max_fraction: float = 0.1, n_points: int = 11) -> list[int]:
    """About ``n_points`` head counts from 0 to round(max_fraction * n_total) (at least 1)."""
    if not 0.0 < max_fraction <= 1.0:
        raise ValueError(f"max_fraction={max_fraction} must be in (0, 1]")
    k_max = max(1, round(max_fraction * n_total))
    return sorted({int(round(x)) for x in np.linspace(0, k_max, min(k_max + 1, n_points))})


def knockout_curve(model: nn.Module, task: Any, scores: HeadScores | torch.Tensor, *, tokenizer: Any = None,
                   ks: Sequence[int] | None = None, max_fraction: float = 0.1, kind: str = KNOCKOUT_KIND,
                   n_random: int = 5, n_samples: int | None = 16, seed: int = 0, metric: Any = "logit_diff",
                   batch_size: int = 8, progress: bool = True, **task_kwargs):
    """Accuracy as the top-k heads (by ``scores``) or k random heads are knocked out.

    ``ks`` defaults to ``default_ks(L*H, max_fraction)`` (0 included: the intact model). Random
    sets draw k heads uniformly from all heads, with seeds ``seed, seed+1, ..., seed+n_random-1``.
    Returns a DataFrame with columns k, fraction, selection ("top" | "random"), seed (None for top),
    accuracy, metric.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    _check_common(kind, batch_size)
    if n_random < 0:
        raise ValueError(f"n_random={n_random} must be >= 0")
    arch = describe(model)
    total = arch.n_total
    s = scores.scores if isinstance(scores, HeadScores) else torch.as_tensor(scores, dtype=torch.float64)  # [L, H]
    if tuple(s.shape) != (arch.n_layers, arch.n_heads):
        raise ValueError(f"knockout_curve: scores are {tuple(s.shape)} (layers x heads) but the model has "
                         f"{(arch.n_layers, arch.n_heads)}; score this model")
    ks = default_ks(total, max_fraction) if ks is None else sorted({int(k) for k in ks})
    if any(not 0 <= k <= total for k in ks):
        raise ValueError(f"knockout_curve: ks={ks} must lie in 0..{total}")
    flat = s.flatten().tolist()
    ranking = [Head(i // arch.n_heads, i % arch.n_heads)
               for i in sorted(range(total), key=lambda i: (-flat[i], i))]
    everyone = [Head(l, h) for l in range(arch.n_layers) for h in range(arch.n_heads)]

    pairs, pad = _pairs_and_pad(model, task, tokenizer, n_samples, seed, task_kwargs)
    m = resolve_metric(metric)
    means = _mean_values(model, pairs, batch_size, pad) if kind == "mean" else None
    runs = [(k, "top", None) for k in ks] + [(k, "random", seed + r) for k in ks if k > 0 for r in range(n_random)]
    rows, intact = [], None
    for k, selection, rseed in tqdm(runs, desc=f"knockout ({kind})", disable=not progress):
        if k == 0:
            intact = intact or _evaluate(model, pairs, [], kind, m, batch_size, pad, None)
            acc, met = intact
        else:
            heads = ranking[:k] if selection == "top" else random.Random(rseed).sample(everyone, k)
            acc, met = _evaluate(model, pairs, heads, kind, m, batch_size, pad, means)
        rows.append({"k": k, "fraction": k / total, "selection": selection, "seed": rseed, "accuracy": acc,
                     "metric": met})
    if 0 in ks:  # the intact model is the k=0 point of every random curve too
        rows += [{**rows[0], "selection": "random", "seed": seed + r} for r in range(n_random)]
    df = pd.DataFrame(rows).sort_values(["selection", "k", "seed"], na_position="first").reset_index(drop=True)
    df.attrs.update({"kind": kind, "task": task_name(task, pairs),
                     "n_samples": len(pairs), "n_total": total})
    return df


def auc(df) -> dict[str, float]:
    """Mean accuracy over the knocked-out fraction (area under accuracy vs fraction / fraction span),
    for the top curve and for the mean of the random curves; ``gap = random - top`` (larger: the
    scores find heads that matter more than chance)."""
    need = {"fraction", "selection", "accuracy"}
    if not need <= set(df.columns):
        raise ValueError(f"auc: df needs columns {sorted(need)}; pass knockout_curve()'s output")
    out = {}
    for sel in ("top", "random"):
        curve = df[df.selection == sel].groupby("fraction")["accuracy"].mean().sort_index()
        if len(curve) == 0:
            out[sel] = float("nan")
        elif len(curve) == 1:
            out[sel] = float(curve.iloc[0])
        else:
            x, y = curve.index.to_numpy(), curve.to_numpy()
            trapz = getattr(np, "trapezoid", None) or np.trapz  # numpy < 2 has only trapz
            out[sel] = float(trapz(y, x) / (x[-1] - x[0]))
    out["gap"] = out["random"] - out["top"]
    return out
