"""Checks during training: a named registry (``CHECKS``) of callables ``fn(ctx: EvalContext) -> dict``, the one
``TrainConfig.eval`` names run every ``eval_every`` steps and at each stage end (a new one: ``register_check``).
(These in-run checks are not ``headscope.evaluate``'s evaluation suites, which score any finished model.)

"default": held-out next-token loss on fixed windows of the shipped held-out haystack text, and single-key
NIAH teacher-forced accuracy (``headscope.ablation.answer_accuracy``) on fixed prompts at the stage's length; in a
stage at another length than the run's first stage, also the held-out loss at that first length
(``eval_heldout_loss_base``), so that every stage is compared on the same windows (a loss at 8192 tokens is not
one at 2048: one measured stage 3 lowered the 8192 loss and raised the 2048 one by 0.35 nats).
"none": no check. Pass any other callable to ``hybrid.train.run(config, evaluate=fn)``.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from headscope.registry import Registry

__all__ = ["EvalContext", "CHECKS", "register_check", "default_eval", "eval_lengths", "MAX_EVAL_LENGTH"]


@dataclass
class EvalContext:
    model: nn.Module  # the model being trained (unwrapped), in eval mode during the call
    tokenizer: Any
    seq_len: int
    n_samples: int
    device: torch.device
    autocast: AbstractContextManager
    seed: int = 0
    cache: dict = field(default_factory=dict)  # per-run memo (fixed evaluation data)
    base_len: int | None = None  # the run's first stage's length: the held-out loss is also taken there


def _with_len(ctx: EvalContext, seq_len: int) -> EvalContext:
    return EvalContext(ctx.model, ctx.tokenizer, seq_len, ctx.n_samples, ctx.device, ctx.autocast, ctx.seed,
                       ctx.cache, ctx.base_len)


@torch.no_grad()
def heldout_loss(ctx: EvalContext) -> float:
    key = ("heldout", ctx.seq_len, ctx.n_samples)
    if key not in ctx.cache:
        from headscope.tasks import load_haystack
        from hybrid.train.text import tokenize_corpus

        ids = tokenize_corpus(ctx.tokenizer, load_haystack("heldout")[:400_000])  # [N]
        T = min(ctx.seq_len, (len(ids) - 1) // max(1, ctx.n_samples))
        g = torch.Generator().manual_seed(10_007 + ctx.seed)
        starts = torch.randint(0, len(ids) - T - 1, (ctx.n_samples,), generator=g, device="cpu")
        ctx.cache[key] = torch.stack([ids[s:s + T] for s in starts.tolist()])  # [n, T]
    rows = ctx.cache[key]
    total, count = 0.0, 0
    for i in range(0, len(rows), 4):
        x = rows[i:i + 4].to(ctx.device)  # [b, T]
        with ctx.autocast:
            logits = ctx.model(input_ids=x, attention_mask=torch.ones_like(x)).logits  # [b, T, V]
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten(),
                                               reduction="sum")
        total += float(ce)
        count += x[:, 1:].numel()
    return total / count


@torch.no_grad()
def niah_accuracy(ctx: EvalContext) -> float:
    key = ("niah", ctx.seq_len, ctx.n_samples)
    if key not in ctx.cache:
        from headscope.tasks import get_task

        task = get_task("niah", context_length=max(64, ctx.seq_len - 8), depth="uniform", haystack="heldout")
        ctx.cache[key] = task.tokenized(ctx.tokenizer, ctx.n_samples, seed=20_011 + ctx.seed)
    from headscope.ablation import answer_accuracy

    with ctx.autocast:  # batch 1: no padding (the hybrid refuses pad tokens)
        return answer_accuracy(ctx.model, ctx.cache[key], batch_size=1)


def default_eval(ctx: EvalContext) -> dict[str, float]:
    out = {"eval_heldout_loss": round(heldout_loss(ctx), 4)}
    if ctx.base_len and ctx.base_len != ctx.seq_len:
        out["eval_heldout_loss_base"] = round(heldout_loss(_with_len(ctx, ctx.base_len)), 4)
        out["heldout_base_len"] = ctx.base_len
    try:
        out["eval_niah_acc"] = round(niah_accuracy(ctx), 4)
    except Exception as err:  # a tokenizer/length the task cannot serve: report, do not stop training
        out["eval_niah_error"] = f"{type(err).__name__}: {err}"[:200]
    return out


CHECKS: Registry[Callable[[EvalContext], dict[str, Any]] | None] = Registry("training check",
                                                                           owner="hybrid.train.CHECKS")


def register_check(name: str, fn: Callable[[EvalContext], dict[str, Any]] | None, *, overwrite: bool = False) -> None:
    """Make ``TrainConfig.eval = name`` run ``fn(ctx) -> {metric: value}`` during training (None: nothing); a taken
    name needs ``overwrite=True``."""
    if fn is not None and not callable(fn):
        raise TypeError(f"register_check({name!r}, ...): fn={fn!r} is not callable; give fn(ctx) -> dict or None")
    CHECKS.register(name, fn, overwrite=overwrite)


register_check("default", default_eval)
register_check("none", None)


MAX_EVAL_LENGTH = 16_384  # NIAH after training, one sequence at a time: longer prompts cost minutes per model
LONG_MULTIPLES = (2, 4, 8)


def eval_lengths(teacher: nn.Module, config, *, cap: int = MAX_EVAL_LENGTH,
                 multiples: tuple[int, ...] = LONG_MULTIPLES) -> tuple[int, tuple[int, ...]]:
    """(L0, long lengths) for the evaluation after a hybrid run (research/train_hybrid/run.py).

    L0, the training length: the longest align / distill ``seq_len`` of ``config`` (a TrainConfig), never past
    the teacher's own (``headscope.evaluate.training_length``: train_summary.json, else max_position_embeddings).
    The reference teacher: 2048 either way. SmolLM2-135M: its config says 8192 positions, but its NIAH accuracy
    falls past 2K (100% at 2K, 80% / 60% at 4K / 8K: docs/tasks.md) and the hybrid is distilled at 2048, so
    2x..8x are counted from 2048, not from 8192 (16K..64K). Long lengths: ``multiples`` x L0, those <= ``cap``
    kept (at least one: the smallest multiple)."""
    from headscope.evaluate import training_length

    from hybrid.train.stages import transfer_lengths

    short = transfer_lengths(config.stages) or [
        min(s.seq_len for s in config.stages)]
    L0 = min(max(short), training_length(teacher))
    long = tuple(m * L0 for m in multiples if m * L0 <= cap) or (min(multiples) * L0,)
    return L0, long
