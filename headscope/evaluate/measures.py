"""Reasoning families by size, held-out perplexity with per-position loss curves, and cost (time, memory, cache)."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from headscope.evaluate.engine import score_pairs, tensor_bytes, window_losses
from headscope.evaluate.rows import accuracy_rows, row, stop_rows
from headscope.evaluate.runtime import (BudgetExceeded, EvalContext, cache_keyword, check_lengths_fit, free_memory,
                                        is_oom, keeps_logits, fewer_rows_after_oom, training_length)

__all__ = ["ReasoningEvalConfig", "PerplexityEvalConfig", "CostEvalConfig", "reasoning", "perplexity", "cost",
           "FAMILY_SIZE_FIELD"]

# the "length" of each reasoning family: the config field that sets how many items the prompt holds
FAMILY_SIZE_FIELD = {"arithmetic": "n_shots", "binding": "n_vars", "comparison": "n_people", "two_hop": "n_people"}
_DEFAULT_SIZES = (("arithmetic", (0, 2, 4)), ("binding", (2, 4, 6, 8)), ("comparison", (2, 3, 5)),
                  ("two_hop", (2, 3, 5)))


def _positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r}: give an int >= 1")


@dataclass(frozen=True)
class ReasoningEvalConfig:
    families: tuple[str, ...] = ("arithmetic", "binding", "comparison", "two_hop")
    sizes: tuple[tuple[str, tuple[int, ...]], ...] = _DEFAULT_SIZES  # per family; () or missing: its default only
    n: int = 50  # prompts per (family, size)
    generate: bool = True
    # per family, task config values (prompt forms: e.g. {"binding": {"n_shots": 6}}); None: the registry's forms
    # of the model evaluated (headscope.zoo.task_defaults; none for other models); {}: every task's plain form.
    # Give them explicitly to compare models on the same prompts (a hybrid of a registry teacher is no registry model)
    forms: Any = None

    def __post_init__(self):
        from headscope.tasks.reasoning import FAMILIES

        bad = [f for f in self.families if f not in FAMILIES]
        if not self.families or bad:
            raise ValueError(f"families={self.families!r}: give names from {sorted(FAMILIES)}")
        if self.forms is not None:
            items = self.forms.items() if isinstance(self.forms, dict) else self.forms
            try:
                forms = tuple(sorted((f, tuple(sorted(dict(kw).items()))) for f, kw in items))
            except (TypeError, ValueError):
                raise ValueError(f"forms={self.forms!r}: give {{family: {{config field: value}}}}") from None
            if any(f not in FAMILIES for f, _ in forms):
                raise ValueError(f"forms={self.forms!r}: keys must be family names from {sorted(FAMILIES)}")
            object.__setattr__(self, "forms", forms)
        sizes = dict((k, tuple(v)) for k, v in (self.sizes.items() if isinstance(self.sizes, dict) else self.sizes))
        if any(k not in FAMILIES for k in sizes):
            raise ValueError(f"sizes={self.sizes!r}: keys must be family names from {sorted(FAMILIES)}")
        object.__setattr__(self, "sizes", tuple(sorted(sizes.items())))
        _positive_int("n", self.n)


def reasoning(model, tokenizer, cfg: ReasoningEvalConfig, ctx: EvalContext) -> list[dict]:
    """Accuracy of each reasoning family, by its size (items in the prompt) where it has one; the sizes of one
    family are scored in one batched pass. Once the time budget is spent the remaining families are skipped."""
    from headscope.tasks import PairError, get_task

    sizes = dict(cfg.sizes)
    if cfg.forms is None:
        from headscope.zoo import task_defaults

        forms = {f: task_defaults(model, f) for f in cfg.families}
    else:
        forms = {f: dict(kw) for f, kw in cfg.forms}
    rows = []
    for j, fam in enumerate(cfg.families):
        fam_sizes = sizes.get(fam) or (None,)
        if ctx.over_budget():
            rows += [r for size in fam_sizes for r in stop_rows("reasoning", {"family": fam, "size": size}, "skipped",
                                                                ctx.budget_note(f"reasoning family {fam}"),
                                                                cfg.generate)]
            continue
        t0 = time.perf_counter()
        ctx.log(f"reasoning {fam}: start (sizes {list(fam_sizes)}, {cfg.n} prompts each)")
        built = []
        for size in fam_sizes:
            fields = {"family": fam, "size": size}
            kw = {**forms.get(fam, {}), **({} if size is None else {FAMILY_SIZE_FIELD[fam]: size})}
            try:
                built.append((fields, get_task(fam, **kw).tokenized(tokenizer, cfg.n,
                                                                    seed=ctx.seed * 1009 + j * 31 + (size or 0))))
            except (PairError, ValueError) as err:
                rows += stop_rows("reasoning", fields, "skipped", str(err).splitlines()[0], cfg.generate)
        pairs = [p for _, ps in built for p in ps]
        t_built = time.perf_counter() - t0
        try:
            res = score_pairs(model, tokenizer, pairs, ctx, generate=cfg.generate, desc=f"reasoning {fam}") \
                if pairs else []
        except BudgetExceeded:
            rows += [r for fields, _ in built for r in stop_rows("reasoning", fields, "skipped",
                                                                 ctx.budget_note(f"reasoning family {fam}"),
                                                                 cfg.generate)]
            ctx.log(f"reasoning {fam}: budget spent after {time.perf_counter() - t0:.1f} s; skipped")
            continue
        at = 0
        for fields, ps in built:
            part = res[at:at + len(ps)]
            at += len(ps)
            tokens = sum(r["prompt_tokens"] for r in part) / len(part)
            rows += accuracy_rows("reasoning", {**fields, "context_length": int(round(tokens))}, part, cfg.generate)
        ctx.log(f"reasoning {fam}: done in {time.perf_counter() - t0:.1f} s ({len(pairs)} prompts, built in "
                f"{t_built:.1f} s)")
    return rows


@dataclass(frozen=True)
class PerplexityEvalConfig:
    lengths: tuple[int, ...] = ()
    multiples: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    n_windows: int = 16  # windows per length (fewer when the text is short)
    text: str = "heldout"  # "heldout" (shipped), "train", a text file path
    bins: int = 32  # per-position loss curve: positions grouped into this many bins
    seed_offsets: bool = False  # False: consecutive windows from the start; True: seeded random offsets

    def __post_init__(self):
        _positive_int("n_windows", self.n_windows)
        _positive_int("bins", self.bins)
        if any(not isinstance(x, int) or x < 2 for x in self.lengths):
            raise ValueError(f"lengths={self.lengths!r}: give ints >= 2 (tokens)")


def perplexity(model, tokenizer, cfg: PerplexityEvalConfig, ctx: EvalContext) -> list[dict]:
    """Held-out perplexity by context length, and mean loss by position (where long context stops helping)."""
    from headscope.tasks import load_haystack
    from headscope.tasks.haystack import tokenize_text

    ids = tokenize_text(tokenizer, load_haystack(cfg.text))  # [N]
    device = next(model.parameters()).device
    train = training_length(model)  # multiples here are whole windows: no answer room
    lengths = sorted(set(cfg.lengths)) if cfg.lengths else sorted({max(2, int(round(m * train)))
                                                                   for m in cfg.multiples})
    rows, stop = [], None
    for L in lengths:
        fields = {"context_length": L}
        n_win = min(cfg.n_windows, (len(ids) - 1) // L)
        if stop is None and ctx.over_budget():
            stop = ctx.budget_note(f"perplexity at {L} tokens and longer")
        why = stop or check_lengths_fit(model, L, extra=0) or (
            None if n_win >= 1 else f"the text has {len(ids)} tokens, too few for one {L}-token window")
        if why:
            status = "stopped" if stop and not stop.startswith("budget:") else "skipped"
            stop = stop or (why if "positions" in why else None)
            rows.append(row("perplexity", "perplexity", None, 0, status=status, note=why, **fields))
            continue
        if cfg.seed_offsets:
            g = torch.Generator().manual_seed(ctx.seed * 7919 + L)
            starts = torch.randint(0, len(ids) - L - 1, (n_win,), generator=g).tolist()
        else:
            starts = [i * L for i in range(n_win)]
        windows = torch.stack([ids[s:s + L + 1] for s in starts])  # [W, L+1]
        t0 = time.perf_counter()
        ctx.log(f"perplexity @{L}: start ({n_win} windows)")
        try:
            # out of memory with several windows per forward: once more one window at a time (as NIAH's scoring)
            loss = fewer_rows_after_oom(lambda c: window_losses(model, windows, c, desc=f"perplexity @{L}"), ctx,
                                        windows.shape[1], device)  # [W, L]
        except BudgetExceeded:
            stop = ctx.budget_note(f"perplexity at {L} tokens and longer")
            rows.append(row("perplexity", "perplexity", None, 0, status="skipped", note=stop, **fields))
            ctx.log(f"perplexity @{L}: budget spent after {time.perf_counter() - t0:.1f} s; this length and longer "
                    "ones skipped")
            continue
        except Exception as err:  # noqa: BLE001
            if not is_oom(err):
                raise
            free_memory(device)
            stop = f"out of memory at {L} tokens on {device}: longer lengths not tried"
            rows.append(row("perplexity", "perplexity", None, 0, status="stopped", note=stop, **fields))
            continue
        ctx.log(f"perplexity @{L}: done in {time.perf_counter() - t0:.1f} s")
        rows.append(row("perplexity", "perplexity", math.exp(float(loss.mean())), n_win, **fields))
        per_pos = loss.mean(0)  # [L]
        edges = sorted({int(round(L * (b + 1) / cfg.bins)) for b in range(cfg.bins)})
        lo = 0
        for hi in edges:
            if hi > lo:
                rows.append(row("perplexity", "loss", float(per_pos[lo:hi].mean()), n_win, position=hi, **fields))
            lo = hi
    return rows


@dataclass(frozen=True)
class CostEvalConfig:
    lengths: tuple[int, ...] = ()
    multiples: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    cpu_max_length: int = 2048  # on a CPU, longer lengths are skipped (rows say so)
    repeats: int = 3  # prefill timings per length (the median is reported)
    decode_context: int = 0  # context for decode time and cache bytes; 0 -> the training length
    decode_tokens: int = 32

    def __post_init__(self):
        for name in ("cpu_max_length", "repeats", "decode_tokens"):
            _positive_int(name, getattr(self, name))
        if isinstance(self.decode_context, bool) or not isinstance(self.decode_context, int) or self.decode_context < 0:
            raise ValueError(f"decode_context={self.decode_context!r}: give an int >= 0 (0: the training length)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _prefill(model, ids: torch.Tensor):
    kw = {"logits_to_keep": 1} if keeps_logits(model) else {}
    return model(input_ids=ids, use_cache=True, **kw)


def cost(model, tokenizer, cfg: CostEvalConfig, ctx: EvalContext) -> list[dict]:
    """Prefill seconds and peak memory by length (batch 1), decode seconds per token and cache bytes."""
    from headscope.tasks import load_haystack
    from headscope.tasks.haystack import tokenize_text

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    train = training_length(model)
    lengths = sorted(set(cfg.lengths)) if cfg.lengths else sorted({max(16, int(round(m * train)))
                                                                   for m in cfg.multiples})
    text = tokenize_text(tokenizer, load_haystack("heldout")[: 8 * max(lengths + [cfg.decode_context or train])])
    need = max(lengths + [cfg.decode_context or train]) + cfg.decode_tokens + 1
    ids_all = text.repeat(need // max(1, len(text)) + 1)[:need]  # [need]
    key = cache_keyword(model)
    rows, stop = [], None
    for L in lengths:
        fields = {"context_length": L}
        if stop is None and ctx.over_budget():
            stop = ctx.budget_note(f"cost at {L} tokens and longer")
        why = stop or check_lengths_fit(model, L, extra=0) or (
            f"CPU: lengths above cpu_max_length={cfg.cpu_max_length} are measured on a GPU only"
            if not cuda and L > cfg.cpu_max_length else None)
        if why:
            status = "stopped" if stop and not stop.startswith("budget:") else "skipped"
            for m in ("prefill_seconds", "peak_memory_bytes"):
                rows.append(row("cost", m, None, 0, status=status, note=why, **fields))
            continue
        ids = ids_all[:L][None].to(device)  # [1, L]
        t_len = time.perf_counter()
        ctx.log(f"cost @{L}: start ({cfg.repeats} + 1 prefills)")
        try:
            times = []
            for _ in range(cfg.repeats + 1):  # the first call warms up
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                _sync(device)
                t0 = time.perf_counter()
                out = _prefill(model, ids)
                _sync(device)
                times.append(time.perf_counter() - t0)
                del out
            peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
        except Exception as err:  # noqa: BLE001
            if not is_oom(err):
                raise
            free_memory(device)
            stop = f"out of memory at {L} tokens on {device}: longer lengths not tried"
            for m in ("prefill_seconds", "peak_memory_bytes"):
                rows.append(row("cost", m, None, 0, status="stopped", note=stop, **fields))
            continue
        ctx.log(f"cost @{L}: done in {time.perf_counter() - t_len:.1f} s")
        rows.append(row("cost", "prefill_seconds", statistics.median(times[1:]), cfg.repeats, **fields))
        rows.append(row("cost", "peak_memory_bytes", peak, 1, status="ok" if cuda else "skipped",
                        note=None if cuda else "peak memory is measured on CUDA devices only", **fields))
    C = cfg.decode_context or train
    fields = {"context_length": C}
    why = check_lengths_fit(model, C + cfg.decode_tokens, extra=0) or (
        f"CPU: decode_context {C} is above cpu_max_length={cfg.cpu_max_length}"
        if not cuda and C > cfg.cpu_max_length else None) or (
        ctx.budget_note(f"decode timing at {C} tokens") if ctx.over_budget() else None)
    if why:
        return rows + [row("cost", m, None, 0, status="skipped", note=why, **fields)
                       for m in ("decode_seconds_per_token", "cache_bytes")]
    t0 = time.perf_counter()
    ctx.log(f"cost decode @{C}: start ({cfg.decode_tokens} tokens)")
    with torch.no_grad():
        out = _prefill(model, ids_all[:C][None].to(device))
        cache = getattr(out, key)
        rows.append(row("cost", "cache_bytes", tensor_bytes(cache), 1, **fields))
        tok = out.logits[:, -1:].argmax(-1)  # [1, 1]
        del out
        _sync(device)
        t1 = time.perf_counter()
        for _ in range(cfg.decode_tokens):
            out = model(input_ids=tok, use_cache=True, **{key: cache})
            cache, tok = getattr(out, key), out.logits[:, -1:].argmax(-1)
        _sync(device)
        rows.append(row("cost", "decode_seconds_per_token", (time.perf_counter() - t1) / cfg.decode_tokens,
                        cfg.decode_tokens, **fields))
    ctx.log(f"cost decode @{C}: done in {time.perf_counter() - t0:.1f} s")
    return rows
