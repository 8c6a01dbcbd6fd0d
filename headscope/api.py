"""``score()``: receiver scores of every head of a model on a task, in one call.

    from headscope.api import score
    s = score(model, "niah", n_samples=8)      # HeadScores; the tokenizer is found (headscope.tokenizers)
    s.top(10); s.to_dataframe()

``model`` is a Hugging Face causal LM (fast exact path), a TransformerLens ``TransformerBridge``, an
nnsight model wrapping a HF model, or a string ("default" / a local folder, loaded by
headscope.reference.load_model). ``backend`` picks the engine by name from ``patching.backends.BACKENDS``:
"auto" (from the model's type), "hf", "naive", "transformer_lens", "nnsight", or one added with
``register_backend``. All give the same scores (tests/headscope/patching).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from headscope.arch import Arch, describe
from headscope.evaluate.lengths import configured_positions
from headscope.metrics import resolve_metric
from headscope.pairs import check_n_samples, task_name, task_pairs
from headscope.patching.backends import BACKENDS, make_backend, resolve_backend
from headscope.patching.engine import receiver_scores
from headscope.patching.inputs import PatchInputError, as_patch_pair
from headscope.patching.nn_sight import is_nnsight_model, unwrap_nnsight
from headscope.results import HeadScores
from headscope.tasks.base import resolve_n_samples
from headscope.tokenizers import unwrap

__all__ = ["score", "BACKENDS"]


def _hf_model(model: Any) -> nn.Module:
    """The Hugging Face model inside a bridge / nnsight wrapper (or the model itself)."""
    if is_nnsight_model(model):
        return unwrap_nnsight(model)  # raises when it holds no torch model
    hf = unwrap(model)
    if not isinstance(hf, nn.Module):
        raise TypeError(f"model must be a Hugging Face causal LM, a TransformerBridge, an nnsight model or a "
                        f"name/path string, got {type(model).__name__}")
    return hf


def prepare_scoring(model: Any, task: Any, tokenizer: Any, n_samples: int | None, seed: int, device: Any,
                    task_config: dict | None, task_kwargs: dict) -> tuple[Any, nn.Module, Arch, list, list, str]:
    """Read a model (object, "default" or a path) and a task (through ``headscope.pairs.task_pairs``) into
    (model, hf model, arch, tokenized pairs, checked patch pairs, task name). Shared by every scorer.
    ``n_samples`` follows ``headscope.tasks.base.resolve_n_samples`` (None: all pairs of a fixed set)."""
    if n_samples is not None:
        check_n_samples(n_samples)  # a bad count fails before the model is loaded
    if isinstance(model, str):
        from headscope.reference import load_model

        model, _ = load_model(model, device=device or "cpu")  # its tokenizer is remembered for task_pairs
    hf = _hf_model(model)
    arch = describe(hf)  # raises UnsupportedModelError for unknown layouts
    if device is not None and not is_nnsight_model(model):
        from headscope.reference import check_device

        model.to(check_device(device))
    n_samples = resolve_n_samples(task, n_samples, model=model, task_options={**(task_config or {}), **task_kwargs})
    raw = task_pairs(model, task, tokenizer=tokenizer, n_samples=n_samples, seed=seed, task_config=task_config,
                     **task_kwargs)
    vocab_size = hf.get_input_embeddings().weight.shape[0]
    name = task_name(task, raw)
    pairs = []
    for i, p in enumerate(raw):
        try:
            pairs.append(as_patch_pair(p, vocab_size=vocab_size, max_positions=configured_positions(hf)))
        except PatchInputError as err:
            prompt = getattr(getattr(p, "pair", None), "short", None)
            what = f"pair {i} of {name!r}" + (f" ({prompt(40)})" if callable(prompt) else "")
            raise PatchInputError(f"{what}: {err}") from None
    return model, hf, arch, raw, pairs, name


def scoring_settings(hf: nn.Module, arch: Any, pairs: list, seed: int, batch_size: int | None,
                     task_config: dict | None, task_kwargs: dict) -> dict:
    """What a scorer records in HeadScores.settings about the model and the pairs."""
    return {"n_samples": len(pairs), "seed": seed, "batch_size": batch_size,
            "model": getattr(hf.config, "_name_or_path", "") or type(hf).__name__,
            "n_layers": arch.n_layers, "n_heads": arch.n_heads,
            "task_config": {**(task_config or {}), **task_kwargs},
            "seq_lens": [p.seq_len for p in pairs], "first_diffs": [p.first_diff for p in pairs],
            "dtype": str(next(hf.parameters()).dtype)}


def score(model: Any, task: Any = "niah", *, tokenizer: Any = None, n_samples: int | None = 8, seed: int = 0,
          metric: "str | Callable" = "logit_diff", backend: str = "auto", batch_size: int | None = None,
          device: "str | torch.device | None" = None, progress: bool = True, on_clean_failure: str = "warn",
          min_clean_accuracy: float = 0.5, task_config: dict | None = None, shard: str | None = None,
          **task_kwargs) -> HeadScores:
    """Receiver score of every head (docs/method.md section 1) on ``n_samples`` pairs of ``task``.

    task: a registered name ("niah", ...), a Task object, or a list of TokenizedPair.
    n_samples: how many pairs; None means all pairs of a task with a fixed set (``tasks.from_pairs``, a list
    of TokenizedPair). A count larger than such a task holds is refused (the message says how many there
    are; pass ``n_samples=None``), so the default 8 needs ``n_samples=None`` (or a smaller count) for a
    smaller ``from_pairs`` task. A generated task ("niah", ...) needs a count.
    tokenizer: found from the model when not given (headscope.tokenizers.find_tokenizer).
    on_clean_failure: "warn" | "drop" | "error" when the clean accuracy is below min_clean_accuracy
    ("drop" scores only the pairs the model answers correctly). Pairs whose corruption does not change
    the metric are dropped with a warning (an error if none is left).
    shard: "heads" | "samples" | "auto" splits the work over the processes of torch.distributed (run under
    torchrun, process group started) and returns the gathered scores on every rank
    (headscope.patching.sharded); None (default): this process scores everything.
    """
    resolve_backend(model, backend)  # a bad name fails before any work
    model, hf, arch, _, pairs, name = prepare_scoring(model, task, tokenizer, n_samples, seed, device,
                                                      task_config, task_kwargs)
    engine = make_backend(model, hf, backend, batch_size)
    settings = scoring_settings(hf, arch, pairs, seed, batch_size, task_config, task_kwargs)
    return receiver_scores(engine, pairs, resolve_metric(metric), task=name, progress=progress,
                           on_clean_failure=on_clean_failure, min_clean_accuracy=min_clean_accuracy,
                           settings=settings, shard=shard)
