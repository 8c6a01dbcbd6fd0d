"""The one scoring engine: answer accuracy of prompt pairs (teacher-forced and generated) and per-position loss.

For a batch of prompts (left-padded with a mask for models that take padding; equal-length batches only for
those that do not, e.g. the hybrid) the prompt is prefilled once with a cache. From that cache:
- teacher forcing: a copy of the cache continues with the gold answer tokens [:-1] in one forward; the pair
  is right when the argmax at every answer position is the gold token (the same quantity as
  ``headscope.ablation.answer_correct``, computed without a second prefill);
- generation (the headline): greedy decoding, one token at a time on the cache, of the answer's length plus
  one token; right when the decoded answer equals the gold one and the next token does not continue it
  (" 4321" followed by "5" is wrong, by "." is right).
"""
from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Sequence

import torch
import torch.nn as nn

from headscope.evaluate.runtime import EvalContext, cache_keyword, keeps_logits, takes_padding

__all__ = ["score_pairs", "exact_match", "window_losses", "tensor_bytes", "pad_id_of"]


def exact_match(answer_logits: torch.Tensor, pair: Any) -> bool:
    """Teacher-forced exact match of one pair: the argmax at each answer position (``answer_logits  # [A, V]``)
    is the gold answer token. The one definition that ``score_pairs`` and ``headscope.knockout`` use."""
    gold = torch.as_tensor(pair.clean_answer_ids, device=answer_logits.device)  # [A]
    return bool((answer_logits.argmax(-1) == gold).all())


def pad_id_of(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            return v
    return 0


def _groups(pairs: Sequence, padding: bool, rows_per_batch) -> list[list[int]]:
    """Batches of pair indices: same answer length; same prompt length too when padding is not allowed."""
    by_key: dict[tuple, list[int]] = defaultdict(list)
    for i, p in enumerate(pairs):
        A, P = len(p.clean_answer_ids), int(p.answer_pos[0]) + 1
        by_key[(A,) if padding else (A, P)].append(i)
    out = []
    for key in sorted(by_key):
        idx = sorted(by_key[key], key=lambda i: int(pairs[i].answer_pos[0]))
        start = 0
        while start < len(idx):
            n = rows_per_batch(int(pairs[idx[-1]].answer_pos[0]) + 1)
            out.append(idx[start:start + n])
            start += n
    return out


def _continues(tokenizer: Any, answer: str, next_id: int) -> bool:
    """True when token ``next_id`` would extend the answer's last word or number (" 4321" + "5")."""
    if not answer or not answer[-1].isalnum():
        return False
    text = tokenizer.decode([next_id])
    return bool(text) and text[0].isalnum()


class _Stepper:
    """Forward calls that continue a cache, with the mask and positions of left-padded rows."""

    def __init__(self, model: nn.Module, mask: torch.Tensor | None, pos: torch.Tensor):
        self.model, self.key = model, cache_keyword(model)
        self.mask = mask  # [B, T] or None (no padding in the batch)
        self.last = pos[:, -1:]  # [B, 1] position of the last token seen
        self.keep = keeps_logits(model)

    def __call__(self, ids: torch.Tensor, cache: Any, advance: bool = True):
        B, n = ids.shape  # ids [B, n]
        kw: dict[str, Any] = {self.key: cache, "use_cache": True}
        pos = self.last + torch.arange(1, n + 1, device=ids.device)  # [B, n]
        if self.mask is not None:
            mask = torch.cat([self.mask, self.mask.new_ones(B, n)], 1)  # [B, T + n]
            kw.update(attention_mask=mask, position_ids=pos)
            if advance:
                self.mask = mask
        if advance:
            self.last = pos[:, -1:]
        out = self.model(input_ids=ids, **kw)
        return out.logits, getattr(out, self.key)  # [B, n, V]


@torch.no_grad()
def score_pairs(model: nn.Module, tokenizer: Any, pairs: Sequence, ctx: EvalContext, *, generate: bool = True,
                desc: str | None = None) -> list[dict[str, Any]]:
    """Per pair: ``{"tf": bool, "gen": bool | None, "prompt_tokens": int, "generated": str | None}``.

    Each pair is a ``TokenizedPair`` (clean prompt + gold answer). See the module docstring. Raises
    ``BudgetExceeded`` before a batch once ``ctx.deadline`` has passed.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    padding, pad = takes_padding(model), pad_id_of(tokenizer)
    key, keep = cache_keyword(model), keeps_logits(model)
    out: list[dict[str, Any]] = [{} for _ in pairs]
    batches = _groups(pairs, padding, ctx.rows_per_batch)
    for k, idx in enumerate(tqdm(batches, desc=desc or "scoring", disable=not ctx.progress or len(batches) < 2,
                                 leave=False)):
        ctx.check_budget(f"{desc or 'scoring'} (batch {k + 1} of {len(batches)})")
        prompts = [pairs[i].clean_ids[: int(pairs[i].answer_pos[0]) + 1] for i in idx]
        B, T = len(idx), max(len(p) for p in prompts)
        ids = torch.full((B, T), pad, dtype=torch.long)  # [B, T]
        mask = torch.zeros(B, T, dtype=torch.long)  # [B, T]
        for b, p in enumerate(prompts):
            ids[b, T - len(p):] = p
            mask[b, T - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
        ragged = bool((mask == 0).any())
        kw: dict[str, Any] = {"use_cache": True}
        if ragged:
            kw.update(attention_mask=mask, position_ids=pos)
        if keep:
            kw["logits_to_keep"] = 1
        res = model(input_ids=ids, **kw)
        first, cache = res.logits[:, -1].argmax(-1), getattr(res, key)  # [B]
        del res
        gold = torch.stack([torch.as_tensor(pairs[i].clean_answer_ids) for i in idx]).to(device)  # [B, A]
        A = gold.shape[1]
        tf = first[:, None]  # [B, 1]
        if A > 1:
            step = _Stepper(model, mask if ragged else None, pos)
            logits, _ = step(gold[:, :-1], copy.deepcopy(cache))  # [B, A-1, V]
            tf = torch.cat([tf, logits.argmax(-1)], 1)  # [B, A]
        tf_ok = (tf == gold).all(-1).cpu()  # [B] (exact_match, batched)
        gen = None
        if generate:
            step = _Stepper(model, mask if ragged else None, pos)
            toks = [first]
            alive = first == gold[:, 0]  # [B] rows whose decoded prefix still equals the gold answer
            for j in range(1, A + 1):
                if not bool(alive.any()):
                    break
                logits, cache = step(toks[-1][:, None], cache)
                toks.append(logits[:, -1].argmax(-1))
                if j < A:
                    alive = alive & (toks[-1] == gold[:, j])
            gen = torch.stack(toks, 1).cpu()  # [B, <= A+1]
        del cache
        for b, i in enumerate(idx):
            row = {"tf": bool(tf_ok[b]), "prompt_tokens": len(prompts[b]), "gen": None, "generated": None}
            if gen is not None:
                g = gen[b].tolist()
                ok = len(g) == A + 1 and g[:A] == gold[b].tolist() and not _continues(
                    tokenizer, pairs[i].pair.clean_answer, g[A])
                row.update(gen=bool(ok), generated=tokenizer.decode(g))
            out[i] = row
    return out


@torch.no_grad()
def window_losses(model: nn.Module, windows: torch.Tensor, ctx: EvalContext, desc: str = "loss") -> torch.Tensor:
    """Next-token cross-entropy at every position of each window: ``windows  # [N, T+1]`` -> ``[N, T]``.

    Equal-length windows, so no padding (any model, hybrids included)."""
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    N, T1 = windows.shape
    step = ctx.rows_per_batch(T1)
    out = torch.empty(N, T1 - 1)  # [N, T]
    for s in tqdm(range(0, N, step), desc=desc, disable=not ctx.progress or N <= step, leave=False):
        ctx.check_budget(f"{desc} (windows {s + 1}.. of {N})")
        x = windows[s:s + step].to(device)  # [b, T+1]
        h = model(input_ids=x[:, :-1], use_cache=False).logits  # [b, T, V]
        for b in range(x.shape[0]):  # one row at a time keeps the float32 copy small
            out[s + b] = F.cross_entropy(h[b].float(), x[b, 1:], reduction="none").cpu()
        del h
    return out


def tensor_bytes(obj: Any, _seen: set | None = None, _depth: int = 0) -> int:
    """Bytes of all tensors reachable from ``obj`` (a cache object, list, dict, ...), each counted once."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen or _depth > 6:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen, _depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen, _depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
        return sum(tensor_bytes(v, seen, _depth + 1) for v in vars(obj).values())
    return 0
