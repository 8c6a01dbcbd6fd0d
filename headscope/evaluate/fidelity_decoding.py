"""The forward passes of the fidelity evaluation, batched like the scoring engine (``headscope.evaluate.engine``):

- ``window_agreement``: student and teacher over the same equal-length windows (no padding, any model):
  per position the NLL under each, KL(teacher || student) and whether the argmaxes agree (float32 log-softmax);
- ``greedy_continuations``: greedy decoding of token-id prompts on the model's cache (the engine's ``_Stepper``),
  left-padded with a mask for models that take padding; a model that takes none but batches rows of any lengths
  itself (``model.greedy_decode(prompts, n)``: the hybrid's static cache) through that, else in equal-length
  batches;
- ``answer_nll``: a model's mean per-token NLL of given answers after their prompts (one forward per batch).

Prompts are batched by length (``ctx.rows_per_batch``), so two models given the same prompts run the same
batches: a model compared with itself gives exactly equal outputs.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from headscope.evaluate.engine import _Stepper
from headscope.evaluate.runtime import EvalContext, cache_keyword, keeps_logits, takes_padding

__all__ = ["window_agreement", "greedy_continuations", "answer_nll", "length_batches", "left_pad"]

_CHUNK_ELEMENTS = 1 << 22  # float32 log-softmax rows at once: positions x vocab (16 MiB)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def window_agreement(student: nn.Module, teacher: nn.Module, windows: torch.Tensor, ctx: EvalContext,
                     desc: str = "fidelity") -> dict[str, torch.Tensor]:
    """``windows  # [N, T+1]`` -> ``{"nll_student", "nll_teacher", "kl", "agree"}``, each ``[N, T]`` (float32; agree
    0/1). KL is KL(teacher || student) in nats. Raises ``BudgetExceeded`` between batches once the budget is spent."""
    from tqdm.auto import tqdm

    N, T1 = windows.shape
    T = T1 - 1
    out = {k: torch.empty(N, T) for k in ("nll_student", "nll_teacher", "kl", "agree")}  # each [N, T]
    step = ctx.rows_per_batch(T1)
    dev_s, dev_t = _device(student), _device(teacher)
    for s in tqdm(range(0, N, step), desc=desc, disable=not ctx.progress or N <= step, leave=False):
        ctx.check_budget(f"{desc} (windows {s + 1}.. of {N})")
        x = windows[s:s + step]  # [b, T+1]
        ls = student(input_ids=x[:, :-1].to(dev_s), use_cache=False).logits  # [b, T, V]
        lt = teacher(input_ids=x[:, :-1].to(dev_t), use_cache=False).logits.to(ls.device)  # [b, T, V]
        if ls.shape[-1] != lt.shape[-1]:
            raise ValueError(f"the student has {ls.shape[-1]} output logits but the teacher {lt.shape[-1]}: fidelity "
                             "compares distributions over one vocabulary; give the student's own teacher")
        tgt_all = x[:, 1:].to(ls.device)  # [b, T]
        chunk = max(1, _CHUNK_ELEMENTS // ls.shape[-1])
        for b in range(x.shape[0]):  # one row (and a chunk of positions) at a time keeps the float32 copies small
            for c in range(0, T, chunk):
                lps = F.log_softmax(ls[b, c:c + chunk].float(), -1)  # [c, V]
                lpt = F.log_softmax(lt[b, c:c + chunk].float(), -1)  # [c, V]
                tgt = tgt_all[b, c:c + chunk, None]  # [c, 1]
                out["nll_student"][s + b, c:c + chunk] = -lps.gather(-1, tgt)[:, 0].cpu()
                out["nll_teacher"][s + b, c:c + chunk] = -lpt.gather(-1, tgt)[:, 0].cpu()
                out["kl"][s + b, c:c + chunk] = (lpt.exp() * (lpt - lps)).sum(-1).cpu()
                out["agree"][s + b, c:c + chunk] = (lps.argmax(-1) == lpt.argmax(-1)).float().cpu()
        del ls, lt
    return out


def length_batches(lengths: Sequence[int], padding: bool, ctx: EvalContext, extra: int = 0) -> list[list[int]]:
    """Indices of sequences batched shortest first; equal lengths only when the model takes no padding; at most
    ``ctx.rows_per_batch(longest + extra)`` per batch."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (padding or lengths[groups[-1][-1]] == lengths[i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    out = []
    for g in groups:
        start = 0
        while start < len(g):
            n = ctx.rows_per_batch(lengths[g[min(len(g), start + ctx.batch_size) - 1]] + extra)
            out.append(g[start:start + n])
            start += n
    return out


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, each ``[B, T]``: the sequences right-aligned, ``pad_id`` / 0 before them."""
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros(B, T, dtype=torch.long)  # [B, T]
    for b, s in enumerate(seqs):
        ids[b, T - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
        mask[b, T - len(s):] = 1
    return ids, mask


def _padded_kw(mask: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor, bool]:
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    ragged = bool((mask == 0).any())
    return ({"attention_mask": mask, "position_ids": pos} if ragged else {}), pos, ragged


@torch.no_grad()
def greedy_continuations(model: nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int, ctx: EvalContext, *,
                         pad_id: int, stop_ids: Collection[int] = (), desc: str = "greedy") -> list[list[int]]:
    """Greedy continuation of each prompt (token ids): ``new_tokens`` tokens, or fewer when a token of
    ``stop_ids`` comes (it is kept, as the answer's end). Batched on the model's cache (see the module docstring)."""
    own_rows = not takes_padding(model) and callable(getattr(model, "greedy_decode", None))
    if own_rows:  # the hybrid: rows of any lengths on its own static cache, instead of equal-length batches
        return _greedy_own_rows(model, prompts, new_tokens, ctx, stop_ids, desc)
    return _greedy_stepwise(model, prompts, new_tokens, ctx, pad_id=pad_id, stop_ids=stop_ids, desc=desc)


@torch.no_grad()
def _greedy_stepwise(model: nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int, ctx: EvalContext, *,
                     pad_id: int, stop_ids: Collection[int] = (), desc: str = "greedy") -> list[list[int]]:
    """``greedy_continuations`` one step at a time on the model's cache: left-padded batches for a model that
    takes padding, equal-length batches for one that does not."""
    from tqdm.auto import tqdm

    device, key = _device(model), cache_keyword(model)
    batches = length_batches([len(p) for p in prompts], takes_padding(model), ctx, new_tokens)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device) if stop_ids else None  # [S]
    out: list[list[int]] = [[] for _ in prompts]
    for k, idx in enumerate(tqdm(batches, desc=desc, disable=not ctx.progress or len(batches) < 2, leave=False)):
        ctx.check_budget(f"{desc} (batch {k + 1} of {len(batches)})")
        ids, mask = left_pad([prompts[i] for i in idx], pad_id)  # [B, T]
        ids, mask = ids.to(device), mask.to(device)
        kw, pos, ragged = _padded_kw(mask)
        if keeps_logits(model):
            kw["logits_to_keep"] = 1
        res = model(input_ids=ids, use_cache=True, **kw)
        toks = [res.logits[:, -1].argmax(-1)]  # [B] each
        cache = getattr(res, key)
        del res
        step = _Stepper(model, mask if ragged else None, pos)
        done = torch.isin(toks[0], stop) if stop is not None else None  # [B]
        for _ in range(new_tokens - 1):
            if done is not None and bool(done.all()):
                break
            logits, cache = step(toks[-1][:, None], cache)  # [B, 1, V]
            toks.append(logits[:, -1].argmax(-1))
            if done is not None:
                done |= torch.isin(toks[-1], stop)
        del cache
        gen = torch.stack(toks, 1).cpu()  # [B, <= new_tokens]
        stops = set(stop_ids)
        for b, i in enumerate(idx):
            out[i] = _until_stop(gen[b].tolist(), stops)
    return out


def _until_stop(seq: list[int], stops: Collection[int]) -> list[int]:
    """``seq`` up to and including its first token of ``stops`` (the answer's end), else whole."""
    end = next((j + 1 for j, t in enumerate(seq) if t in stops), len(seq))
    return seq[:end]


@torch.no_grad()
def _greedy_own_rows(model: nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int, ctx: EvalContext,
                     stop_ids: Collection[int], desc: str) -> list[list[int]]:
    """``greedy_continuations`` through ``model.greedy_decode(prompts, n)`` (a model that batches rows of any
    lengths itself, such as the hybrid): batches by length as for a model that takes padding; every row runs
    ``new_tokens`` steps and is cut after its first stop token, which gives the tokens of the step-by-step loop."""
    from tqdm.auto import tqdm

    device, stops = _device(model), set(stop_ids)
    batches = length_batches([len(p) for p in prompts], True, ctx, new_tokens)
    out: list[list[int]] = [[] for _ in prompts]
    for k, idx in enumerate(tqdm(batches, desc=desc, disable=not ctx.progress or len(batches) < 2, leave=False)):
        ctx.check_budget(f"{desc} (batch {k + 1} of {len(batches)})")
        rows = [torch.tensor(list(prompts[i]), dtype=torch.long, device=device) for i in idx]  # each [T_i]
        gen = model.greedy_decode(rows, new_tokens).cpu()  # [B, new_tokens]
        for b, i in enumerate(idx):
            out[i] = _until_stop(gen[b].tolist(), stops)
    return out


@torch.no_grad()
def answer_nll(model: nn.Module, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
               ctx: EvalContext, *, pad_id: int, desc: str = "answer NLL") -> list[float]:
    """The model's mean per-token NLL (nats, float32) of each answer after its prompt (teacher forcing)."""
    from tqdm.auto import tqdm

    if any(len(a) == 0 for a in answers):
        raise ValueError("answer_nll: every answer needs at least one token")
    device = _device(model)
    seqs = [list(p) + list(a) for p, a in zip(prompts, answers, strict=True)]
    batches = length_batches([len(s) for s in seqs], takes_padding(model), ctx)
    out = [0.0] * len(seqs)
    for k, idx in enumerate(tqdm(batches, desc=desc, disable=not ctx.progress or len(batches) < 2, leave=False)):
        ctx.check_budget(f"{desc} (batch {k + 1} of {len(batches)})")
        ids, mask = left_pad([seqs[i] for i in idx], pad_id)  # [B, T]
        ids, mask = ids.to(device), mask.to(device)
        kw, _, _ = _padded_kw(mask)
        A = max(len(answers[i]) for i in idx)
        if keeps_logits(model):
            kw["logits_to_keep"] = A + 1
        logits = model(input_ids=ids, use_cache=False, **kw).logits[:, -(A + 1):]  # [B, A+1, V]
        for b, i in enumerate(idx):
            a = len(answers[i])
            pred = logits[b, A - a: A].float()  # [a, V]: the positions before each answer token
            gold = ids[b, -a:]  # [a]
            out[i] = float(F.cross_entropy(pred, gold, reduction="mean"))
        del logits
    return out
