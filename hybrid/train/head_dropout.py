"""Head dropout for training: each (row, head) output is replaced, with probability p, by that head's mean.

The mean is over the batch's rows and positions, detached: the replacement is the "mean ablation" that
``headscope.ablation`` and the reference evaluation use for knockouts. Training under it teaches the model
not to hang everything on one head, so knocking out a few random heads costs little, while a function that
lives in a few specialised heads (retrieval) is still removed by knocking those heads out.

    with head_dropout(model, p=0.03):
        loss = model(input_ids=ids).logits ...

Pre-forward hooks on every layer's output projection (found by ``headscope.arch.describe``); they act
only while ``model.training`` is true and are removed when the block exits.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn


def drop_heads(z: torch.Tensor, n_heads: int, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """z [B, T, H*D] -> z with each (row, head) slice replaced by the head's batch mean with probability p."""
    B, T, HD = z.shape
    zh = z.view(B, T, n_heads, HD // n_heads)  # [B, T, H, D]
    drop = torch.rand(B, 1, n_heads, 1, device=z.device, generator=generator) < p  # [B, 1, H, 1]
    mean = zh.detach().mean(dim=(0, 1), keepdim=True)  # [1, 1, H, D]
    return torch.where(drop, mean.to(zh.dtype), zh).view(B, T, HD)  # [B, T, H*D]


@contextmanager
def head_dropout(model: nn.Module, p: float) -> Iterator[None]:
    """Mean-replace random heads in every layer while ``model.training`` (see module doc)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"head_dropout p={p!r}: give a probability in [0, 1)")
    if p == 0.0:
        yield
        return
    from headscope.arch import describe

    from headscope.hooks import hooks, pre

    arch = describe(model)

    def hook(module, args):
        if not model.training:
            return None
        return (drop_heads(args[0], arch.n_heads, p),) + tuple(args[1:])

    with hooks(pre(proj, hook) for proj in arch.out_projs):
        yield
