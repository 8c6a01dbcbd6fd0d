"""Knock heads out and measure answer accuracy.

    with ablate_heads(model, [Head(3, 1), Head(5, 0)], kind="zero"):
        acc = answer_accuracy(model, tokenized_pairs)

A head's output is its slice of the output projection's input (``z  # [B, T, H*D]``, located with
``headscope.arch.describe``). ``kind`` says what replaces it:
- "zero":  0.
- "mean":  its mean over reference prompts, ``head_means(model, batches)  # [L, H, D]`` (pass it as
  ``values``, or pass ``batches`` and it is computed here).
- "patch": supplied values, ``{Head: tensor}`` each broadcastable to ``[B, T, D]`` (e.g. the head's
  output on a corrupted prompt).
Hooks (``headscope.hooks``) live only inside the ``with`` block.
"""
from __future__ import annotations

import inspect
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn

from headscope.arch import describe
from headscope.heads import Head
from headscope.hooks import hooks, pre

__all__ = ["ablate_heads", "head_means", "answer_correct", "answer_accuracy", "ABLATION_KINDS"]

ABLATION_KINDS = ("zero", "mean", "patch")


def _as_heads(heads: Iterable, n_layers: int, n_heads: int) -> list[Head]:
    out = [Head.from_any(h) for h in heads]
    for h in out:
        if h.layer >= n_layers or h.head >= n_heads:
            raise ValueError(f"{h} is outside the model ({n_layers} layers x {n_heads} heads)")
    return sorted(set(out))


def _value_for(values, h: Head) -> torch.Tensor:
    if isinstance(values, torch.Tensor):  # [L, H, D] (head_means) or [L, H, ..., D]
        return values[h.layer, h.head]
    if h not in values:
        raise KeyError(f"no value supplied for {h}; values must hold every ablated head")
    return torch.as_tensor(values[h])


@contextmanager
def ablate_heads(model: nn.Module, heads: Iterable, kind: str = "zero",
                 values: torch.Tensor | Mapping[Head, torch.Tensor] | None = None,
                 batches: Sequence | None = None) -> Iterator[nn.Module]:
    """Replace the outputs of ``heads`` inside the block; see the module docstring."""
    if kind not in ABLATION_KINDS:
        raise ValueError(f"ablate_heads: kind={kind!r} is not one of {ABLATION_KINDS}")
    arch = describe(model)
    heads = _as_heads(heads, arch.n_layers, arch.n_heads)
    if kind == "mean" and values is None:
        if batches is None:
            raise ValueError("ablate_heads(kind='mean') needs values=head_means(model, batches) or batches=[...]")
        values = head_means(model, batches)  # [L, H, D]
    if kind == "patch" and values is None:
        raise ValueError("ablate_heads(kind='patch') needs values={Head: tensor [B, T, D]}")
    by_layer: dict[int, list[Head]] = defaultdict(list)
    for h in heads:
        by_layer[h.layer].append(h)

    def make_hook(layer_heads: list[Head]):
        def hook(module, args, kwargs):
            z = args[0].clone()  # [B, T, H*D]
            for h in layer_heads:
                sl = arch.head_slice(h.head)
                if kind == "zero":
                    z[..., sl] = 0.0
                else:
                    v = _value_for(values, h).to(device=z.device, dtype=z.dtype)  # [D] or [B, T, D]
                    z[..., sl] = v.expand_as(z[..., sl])
            return (z,) + tuple(args[1:]), kwargs
        return hook

    with hooks(pre(arch.out_projs[layer], make_hook(layer_heads), with_kwargs=True)
               for layer, layer_heads in by_layer.items()):
        yield model


@torch.no_grad()
def head_means(model: nn.Module, batches: Sequence) -> torch.Tensor:
    """Mean output of every head over all (non-padding) positions of ``batches``.

    ``batches``: input_ids tensors ``[B, T]`` / ``[T]``, or dicts with ``input_ids`` (and optionally
    ``attention_mask``). Returns ``[L, H, D]``.
    """
    arch = describe(model)
    sums = torch.zeros(arch.n_layers, arch.n_heads, arch.head_dim, dtype=torch.float64)  # [L, H, D]
    count = torch.zeros((), dtype=torch.float64)
    mask_box: dict[str, torch.Tensor] = {}

    def make_hook(layer: int):
        def hook(module, args):
            z = args[0].detach().double()  # [B, T, H*D]
            m = mask_box["mask"].to(z.device, z.dtype)  # [B, T]
            zs = (z * m[..., None]).sum((0, 1)).view(arch.n_heads, arch.head_dim)  # [H, D]
            sums[layer] += zs.cpu()
        return hook

    device = next(model.parameters()).device
    with hooks(pre(proj, make_hook(layer)) for layer, proj in enumerate(arch.out_projs)):
        for batch in batches:
            if isinstance(batch, Mapping):
                ids, mask = batch["input_ids"], batch.get("attention_mask")
            else:
                ids, mask = batch, None
            ids = torch.as_tensor(ids)
            ids = ids[None] if ids.dim() == 1 else ids  # [B, T]
            mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask).view_as(ids)  # [B, T]
            mask_box["mask"] = mask
            count += mask.sum()
            model(input_ids=ids.to(device), attention_mask=mask.to(device))
    if count == 0:
        raise ValueError("head_means: batches hold no tokens")
    return (sums / count).float()  # [L, H, D]


@torch.no_grad()
def answer_correct(model: nn.Module, pairs: Sequence, batch_size: int = 8, pad_id: int = 0) -> torch.Tensor:
    """Greedy exact match per pair, by teacher forcing on the clean prompt: ``[N]`` bool.

    Each pair (a ``TokenizedPair``) has ``clean_ids  # [T]`` (prompt + answer[:-1]), ``answer_pos  # [A]``
    (the positions whose next-token logits predict the answer) and ``clean_answer_ids  # [A]``.
    Argmax at every answer position equal to the answer token <=> greedy decoding yields the answer.
    """
    if batch_size < 1:
        raise ValueError(f"answer_correct: batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    keep_ok = "logits_to_keep" in inspect.signature(model.forward).parameters
    out = torch.zeros(len(pairs), dtype=torch.bool)  # [N]
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i].clean_ids))  # similar lengths together
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        seqs = [torch.as_tensor(pairs[i].clean_ids, dtype=torch.long) for i in idx]
        T = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)  # [B, T]
        mask = torch.zeros(len(seqs), T, dtype=torch.long)  # [B, T]
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = s
            mask[b, :len(s)] = 1
        first = min(int(torch.as_tensor(pairs[i].answer_pos).min()) for i in idx)
        kw = {"logits_to_keep": T - first} if keep_ok else {}  # only the answer positions' logits
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), **kw).logits  # [B, T', V]
        shift = T - logits.shape[1]
        for b, i in enumerate(idx):
            pos = torch.as_tensor(pairs[i].answer_pos, dtype=torch.long, device=device) - shift  # [A]
            want = torch.as_tensor(pairs[i].clean_answer_ids, dtype=torch.long, device=device)  # [A]
            out[i] = bool((logits[b, pos].argmax(-1) == want).all())
    return out


def answer_accuracy(model: nn.Module, pairs: Sequence, batch_size: int = 8, pad_id: int = 0) -> float:
    """Fraction of pairs whose clean answer the model produces greedily (see ``answer_correct``)."""
    if len(pairs) == 0:
        raise ValueError("answer_accuracy: no pairs given")
    return float(answer_correct(model, pairs, batch_size, pad_id).float().mean())
