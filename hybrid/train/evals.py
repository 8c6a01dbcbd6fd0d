"""Periodic evaluations during training: a named registry of callables ``fn(ctx: EvalContext) -> dict``.

"default": held-out next-token loss on fixed windows of the shipped held-out haystack text, and single-key
NIAH teacher-forced accuracy (``headscope.ablation.answer_accuracy``) on fixed prompts at the stage's length.
"none": no evaluation. Pass any other callable to ``hybrid.train.run(config, evaluate=fn)``.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

__all__ = ["EvalContext", "EVALUATIONS", "register_evaluation", "default_eval"]


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


@torch.no_grad()
def heldout_loss(ctx: EvalContext) -> float:
    key = ("heldout", ctx.seq_len, ctx.n_samples)
    if key not in ctx.cache:
        from headscope.tasks import load_haystack
        from hybrid.train.data import tokenize_corpus

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
    try:
        out["eval_niah_acc"] = round(niah_accuracy(ctx), 4)
    except Exception as err:  # a tokenizer/length the task cannot serve: report, do not stop training
        out["eval_niah_error"] = f"{type(err).__name__}: {err}"[:200]
    return out


EVALUATIONS: dict[str, Callable[[EvalContext], dict[str, Any]] | None] = {}


def register_evaluation(name: str, fn: Callable[[EvalContext], dict[str, Any]] | None) -> None:
    EVALUATIONS[name] = fn


register_evaluation("default", default_eval)
register_evaluation("none", None)


# ---- after training: the hybrid against its teacher ----------------------------------------------------
@torch.no_grad()
def heldout_perplexity(model: nn.Module, tokenizer, seq_len: int, n: int, device, autocast, seed: int = 0) -> float:
    import math

    ctx = EvalContext(model, tokenizer, seq_len, n, device, autocast, seed)
    return math.exp(heldout_loss(ctx))


@torch.no_grad()
def compare(models: dict[str, nn.Module], tokenizer, *, length: int, long_lengths: tuple[int, ...] = (),
            n: int = 50, n_reasoning: int = 100, n_keys: int = 4, ppl_windows: int = 32, seed: int = 12_345,
            progress: bool = True, task_config: dict[str, dict] | None = None):
    """Each model on: single-key NIAH at ``length`` and at each of ``long_lengths``, multi-key NIAH at
    ``length`` (``n_keys`` keys), each reasoning family, held-out perplexity at ``length``. Held-out haystack,
    fresh seeds, greedy answers by teacher forcing, one sequence at a time (no padding). A DataFrame with one
    row per metric and one column per model. ``task_config``: {task name: config values} under the ones set
    here, e.g. a registry teacher's prompt forms (``headscope.zoo.task_defaults``: SmolLM2's few-shot forms)."""
    import pandas as pd
    from tqdm.auto import tqdm

    from headscope.ablation import answer_accuracy
    from headscope.tasks import get_task
    from headscope.tasks.reasoning import FAMILIES

    specs: list[tuple[str, Any]] = [(f"niah@{length}", ("niah", dict(context_length=length - 8, depth="uniform",
                                                                      haystack="heldout"), n))]
    specs.append((f"multikey@{length}", ("niah_multikey", dict(context_length=length - 8, depth="random",
                                                               haystack="heldout", n_keys=n_keys), n)))
    specs += [(f"reasoning_{fam}", (fam, {}, n_reasoning)) for fam in FAMILIES]
    specs += [(f"niah@{L}", ("niah", dict(context_length=L - 8, depth="uniform", haystack="heldout"), n))
              for L in long_lengths]
    rows: dict[str, dict[str, float]] = {}
    bar = tqdm(total=len(specs) * len(models) + len(models), desc="compare", disable=not progress)
    for i, (label, (task, cfg, count)) in enumerate(specs):
        pairs = get_task(task, **{**(task_config or {}).get(task, {}), **cfg}).tokenized(tokenizer, count,
                                                                                     seed=seed + i)
        rows[label] = {}
        for name, model in models.items():
            device = next(model.parameters()).device
            ac = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
                "cpu", enabled=False)
            with ac:
                rows[label][name] = answer_accuracy(model.eval(), pairs, batch_size=1)
            bar.update(1)
    rows[f"ppl@{length}"] = {}
    for name, model in models.items():
        device = next(model.parameters()).device
        ac = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
            "cpu", enabled=False)
        rows[f"ppl@{length}"][name] = heldout_perplexity(model.eval(), tokenizer, length, ppl_windows, device, ac)
        bar.update(1)
    bar.close()
    return pd.DataFrame(rows).T


MAX_EVAL_LENGTH = 16_384  # NIAH after training, one sequence at a time: longer prompts cost minutes per model
LONG_MULTIPLES = (2, 4, 8)


def eval_lengths(teacher: nn.Module, config, *, cap: int = MAX_EVAL_LENGTH,
                 multiples: tuple[int, ...] = LONG_MULTIPLES) -> tuple[int, tuple[int, ...]]:
    """(L0, long lengths) for ``compare`` after a hybrid run.

    L0, the training length: the longest align / distill ``seq_len`` of ``config`` (a TrainConfig), never past
    the teacher's own (``headscope.evaluate.training_length``: train_summary.json, else max_position_embeddings).
    The reference teacher: 2048 either way. SmolLM2-135M: its config says 8192 positions, but its NIAH accuracy
    falls past 2K (100% at 2K, 80% / 60% at 4K / 8K: docs/tasks.md) and the hybrid is distilled at 2048, so
    2x..8x are counted from 2048, not from 8192 (16K..64K). Long lengths: ``multiples`` x L0, those <= ``cap``
    kept (at least one: the smallest multiple)."""
    from headscope.evaluate import training_length

    short = [s.seq_len for s in config.stages if s.name in ("align", "distill")] or [
        min(s.seq_len for s in config.stages)]
    L0 = min(max(short), training_length(teacher))
    long = tuple(m * L0 for m in multiples if m * L0 <= cap) or (min(multiples) * L0,)
    return L0, long
