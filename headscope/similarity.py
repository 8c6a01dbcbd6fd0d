"""The paper's motivating picture: layers change the residual stream smoothly, heads inside a layer differ.

    sim = layer_similarity(model, "niah")       # DataFrame [L+1, L+1], cosine of residual streams
    adjacent_layer_similarity(sim)              # cos(layer i, layer i+1), i = 0..L-1
    head_score_spread(scores)                   # per layer: std, min, max, max-min of head scores

Row/column 0 is the embedding output (the residual stream entering layer 0); row i (1..L) is the
residual stream after decoder layer i-1, captured with forward hooks on the decoder layers (not
``output_hidden_states``, whose last entry some families return after the final norm).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn as nn

from headscope.arch import describe
from headscope.hooks import hooks, post
from headscope.pairs import task_pairs
from headscope.results import HeadScores

__all__ = ["layer_similarity", "adjacent_layer_similarity", "head_score_spread"]


def _ids_of(x) -> torch.Tensor:
    """input ids ``[T]`` of a TokenizedPair (its clean prompt), a tensor or a list of ints."""
    ids = getattr(x, "clean_ids", x)
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"layer_similarity: each input must be a non-empty [T] id sequence, "
                         f"got shape {tuple(ids.shape)}")
    return ids  # [T]


@contextmanager
def _record_residuals(model: nn.Module, store: list) -> Iterator[None]:
    """Append the residual stream after each decoder layer (``[T, C]`` of batch row 0) to ``store``."""
    arch = describe(model)

    def hook(module, args, output):
        h = output[0] if isinstance(output, (tuple, list)) else output  # [B, T, C]
        store.append(h[0].detach().double().cpu())

    with hooks(post(layer, hook) for layer in arch.layers):
        yield


@torch.no_grad()
def layer_similarity(model: nn.Module, task: Any = "niah", *, tokenizer: Any = None, n_samples: int = 8,
                     seed: int = 0, progress: bool = False, **task_kwargs):
    """Mean over inputs and tokens of cos(residual_i[t], residual_j[t]): a DataFrame ``[L+1, L+1]``.

    ``task``: a task name or Task (its pairs from ``headscope.pairs.task_pairs``), or a list of inputs:
    TokenizedPairs (their clean prompts are used), ``[T]`` id tensors or lists of ids.
    Index/columns are "embed", "L0", ..., "L{L-1}" (stream after that layer).
    """
    import pandas as pd
    from tqdm.auto import tqdm

    if isinstance(task, (list, tuple)):
        if len(task) == 0:
            raise ValueError("layer_similarity: no inputs given")
        if task_kwargs:
            raise ValueError(f"layer_similarity: task options {sorted(task_kwargs)} only apply to a task name")
        tokenized_inputs = list(task)
    else:
        tokenized_inputs = task_pairs(model, task, tokenizer=tokenizer, n_samples=n_samples, seed=seed,
                                      **task_kwargs)
    arch = describe(model)
    device = next(model.parameters()).device
    total = torch.zeros(arch.n_layers + 1, arch.n_layers + 1, dtype=torch.float64)  # [L+1, L+1]
    for x in tqdm(tokenized_inputs, desc="layer similarity", disable=not progress):
        ids = _ids_of(x)  # [T]
        store: list[torch.Tensor] = []
        with _record_residuals(model, store):
            out = model(input_ids=ids[None].to(device), output_hidden_states=True)
        h = torch.stack([out.hidden_states[0][0].double().cpu()] + store)  # [L+1, T, C]
        h = h / h.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        total += torch.einsum("itc,jtc->ij", h, h) / h.shape[1]
    sim = (total / len(tokenized_inputs)).numpy()
    names = ["embed"] + [f"L{l}" for l in range(arch.n_layers)]
    return pd.DataFrame(sim, index=names, columns=names)


def adjacent_layer_similarity(sim):
    """cos(stream before layer i, stream after layer i) for i = 0..L-1, from ``layer_similarity``'s output.

    Returns a DataFrame with columns layer, similarity.
    """
    import numpy as np
    import pandas as pd

    m = np.asarray(sim, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 2:
        raise ValueError(f"adjacent_layer_similarity: expected a square [L+1, L+1] matrix, got shape {m.shape}")
    return pd.DataFrame({"layer": np.arange(m.shape[0] - 1), "similarity": np.diag(m, 1)})


def head_score_spread(scores: HeadScores | torch.Tensor, threshold: float = 0.1):
    """Per layer: mean, std, min, max, range (max - min) of its heads' scores, the best head, and how
    many heads exceed ``threshold``. Large ranges inside layers are what head-level selection exploits."""
    import pandas as pd

    s = scores.scores if isinstance(scores, HeadScores) else torch.as_tensor(scores, dtype=torch.float64)  # [L, H]
    if s.dim() != 2:
        raise ValueError(f"head_score_spread: scores must be [layers, heads], got shape {tuple(s.shape)}")
    rows = []
    for l, row in enumerate(s):
        rows.append({"layer": l, "mean": float(row.mean()), "std": float(row.std(unbiased=False)),
                     "min": float(row.min()), "max": float(row.max()), "range": float(row.max() - row.min()),
                     "best_head": int(row.argmax()), "n_above": int((row > threshold).sum())})
    return pd.DataFrame(rows)
