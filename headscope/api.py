"""``score()``: receiver scores of every head of a model on a task, in one call.

    from headscope.api import score
    s = score(model, "niah", tokenizer=tok, n_samples=8)      # HeadScores
    s.top(10); s.to_dataframe()

``model`` is a Hugging Face causal LM (fast exact path), a TransformerLens ``TransformerBridge``, an
nnsight model wrapping a HF model, or a string ("default" / a local folder, loaded by
headscope.reference.load_model). ``backend`` picks the engine: "auto" (from the model's type), "hf",
"naive", "transformer_lens", "nnsight". All give the same scores (tests/headscope/patching).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from headscope.arch import describe
from headscope.metrics import resolve_metric
from headscope.patching.engine import NaiveBackend, receiver_scores
from headscope.patching.hf import HFBackend, HFFastConfig
from headscope.patching.inputs import PatchInputError, as_patch_pair
from headscope.patching.nn_sight import NNsightBackend, is_nnsight_model, unwrap_nnsight
from headscope.patching.tl import TLBackend, is_transformer_bridge
from headscope.results import HeadScores

__all__ = ["score", "BACKENDS"]

BACKENDS = ("auto", "hf", "naive", "transformer_lens", "nnsight")


def _hf_model(model: Any) -> nn.Module:
    """The Hugging Face model inside a bridge / nnsight wrapper (or the model itself)."""
    if is_transformer_bridge(model):
        return model.original_model
    if is_nnsight_model(model):
        return unwrap_nnsight(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a Hugging Face causal LM, a TransformerBridge, an nnsight model or a "
                        f"name/path string, got {type(model).__name__}")
    return model


def _max_positions(hf: nn.Module) -> int | None:
    cfg = hf.config
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _check_tokenizer(tokenizer: Any, vocab_size: int) -> None:
    n = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)
    if n is not None and n > vocab_size:
        raise PatchInputError(f"the tokenizer has {n} tokens but the model's embedding has {vocab_size} rows: "
                              "the tokenizer does not match the model; pass the model's own tokenizer")


def _make_backend(model: Any, hf: nn.Module, backend: str, batch_size: int | None):
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {BACKENDS}")
    if backend == "auto":
        backend = ("transformer_lens" if is_transformer_bridge(model) else
                   "nnsight" if is_nnsight_model(model) else "hf")
    if backend == "transformer_lens":
        if not is_transformer_bridge(model):
            raise TypeError("backend='transformer_lens' needs a TransformerBridge: "
                            "headscope.patching.tl.bridge_from_hf(model, tokenizer)")
        return TLBackend(model, batch_size)
    if backend == "nnsight":
        if not is_nnsight_model(model):
            raise TypeError("backend='nnsight' needs an nnsight model: nnsight.NNsight(model) or LanguageModel")
        return NNsightBackend(model, batch_size)
    if backend == "naive":
        return NaiveBackend(hf)
    return HFBackend(hf, HFFastConfig(batch_size=batch_size))


def prepare_pairs(model: Any, task: Any, tokenizer: Any, n_samples: int, seed: int, device: Any,
                  task_config: dict | None, task_kwargs: dict) -> tuple[Any, nn.Module, Any, list, list, str]:
    """Read a model (object, "default" or a path) and a task (name, Task or list of TokenizedPair) into
    (model, hf model, arch, raw pairs, checked patch pairs, task name). Shared by every scorer."""
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be an int >= 1, got {n_samples!r}")
    if isinstance(model, str):
        from headscope.reference import load_model

        model, loaded_tok = load_model(model, device=device or "cpu")
        tokenizer = tokenizer or loaded_tok
    hf = _hf_model(model)
    arch = describe(hf)  # raises UnsupportedModelError for unknown layouts
    if device is not None and not is_nnsight_model(model):
        model.to(device)
    tokenizer = tokenizer or getattr(model, "tokenizer", None)
    vocab_size = hf.get_input_embeddings().weight.shape[0]

    if isinstance(task, (list, tuple)):
        raw_pairs: list[Any] = list(task)
        task_name = getattr(getattr(raw_pairs[0], "pair", None), "task", "custom") if raw_pairs else "custom"
    else:
        if isinstance(task, str):
            from headscope.tasks import get_task

            task = get_task(task, **{**(task_config or {}), **task_kwargs})
        elif task_config or task_kwargs:
            raise ValueError("task_config / task keyword arguments only apply to a task given by name")
        if not hasattr(task, "tokenized"):
            raise TypeError(f"task must be a name, a Task or a list of TokenizedPair, got {type(task).__name__}")
        if tokenizer is None:
            raise ValueError("no tokenizer: pass tokenizer=..., or a model that carries one (TransformerBridge, "
                             "nnsight LanguageModel, or a name/path string)")
        _check_tokenizer(tokenizer, vocab_size)
        task_name = getattr(task, "name", type(task).__name__)
        raw_pairs = task.tokenized(tokenizer, n_samples, seed)
    if not raw_pairs:
        raise ValueError("no pairs to score: pass n_samples >= 1 or a non-empty list of pairs")
    pairs = [as_patch_pair(p, vocab_size=vocab_size, max_positions=_max_positions(hf)) for p in raw_pairs]
    return model, hf, arch, raw_pairs, pairs, task_name



def scoring_settings(hf: nn.Module, arch: Any, pairs: list, seed: int, batch_size: int | None,
                     task_config: dict | None, task_kwargs: dict) -> dict:
    """What a scorer records in HeadScores.settings about the model and the pairs."""
    return {"n_samples": len(pairs), "seed": seed, "batch_size": batch_size,
            "model": getattr(hf.config, "_name_or_path", "") or type(hf).__name__,
            "n_layers": arch.n_layers, "n_heads": arch.n_heads,
            "task_config": {**(task_config or {}), **task_kwargs},
            "seq_lens": [p.seq_len for p in pairs], "first_diffs": [p.first_diff for p in pairs],
            "dtype": str(next(hf.parameters()).dtype)}


def score(model: Any, task: Any = "niah", *, tokenizer: Any = None, n_samples: int = 8, seed: int = 0,
          metric: "str | Callable" = "logit_diff", backend: str = "auto", batch_size: int | None = None,
          device: "str | torch.device | None" = None, progress: bool = True, on_clean_failure: str = "warn",
          min_clean_accuracy: float = 0.5, task_config: dict | None = None, **task_kwargs) -> HeadScores:
    """Receiver score of every head (METHOD.md section 1) on ``n_samples`` pairs of ``task``.

    task: a registered name ("niah", ...), a Task object, or a list of TokenizedPair.
    on_clean_failure: "warn" | "drop" | "error" when the clean accuracy is below min_clean_accuracy
    ("drop" scores only the pairs the model answers correctly). Pairs whose corruption does not change
    the metric are dropped with a warning (an error if none is left).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {BACKENDS}")
    model, hf, arch, _, pairs, task_name = prepare_pairs(model, task, tokenizer, n_samples, seed, device,
                                                         task_config, task_kwargs)

    engine = _make_backend(model, hf, backend, batch_size)
    settings = scoring_settings(hf, arch, pairs, seed, batch_size, task_config, task_kwargs)
    return receiver_scores(engine, pairs, resolve_metric(metric), task=task_name, progress=progress,
                           on_clean_failure=on_clean_failure, min_clean_accuracy=min_clean_accuracy,
                           settings=settings)
