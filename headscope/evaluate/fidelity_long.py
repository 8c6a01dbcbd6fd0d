"""Fidelity past the teacher's context: a student (a hybrid) at lengths its teacher was not trained to read.

    df = headscope.evaluate(student, suite="fidelity_long", teacher=teacher, tokenizer=tok)
    headscope eval --model STUDENT --teacher TEACHER --suite fidelity_long --out DIR

Two evaluations (registered with ``needs_teacher=True``), on the held-out data of the fidelity suite
(``headscope/evaluate/data/fidelity``, never a training source):

- ``fidelity_long_text``: per held-out source (``family``) and window length (``context_length``: 8K, 16K, 32K by
  default), ``perplexity_student`` of windows of the source. Where the teacher has the positions (the window fits its
  ``max_position_embeddings``), the rows of ``fidelity_text`` from one forward of each model: ``perplexity_teacher``,
  ``perplexity_ratio``, ``kl_to_teacher``, ``top1_agreement``. Past them those rows have status "not_applicable" and a
  note (a RoPE teacher runs there, but what it scores is not a reference to retain). At every length,
  ``perplexity_teacher_chunked``: the teacher's perplexity of the same tokens read in consecutive chunks of its
  positions, each chunk from an empty context (the teacher's score where it can run; one chunk, so equal to
  ``perplexity_teacher``, when the window fits), and ``perplexity_ratio_chunked`` = student / that: below 1, the
  student reads the long context better than a teacher that must forget it every ``positions`` tokens. And
  ``perplexity_student_chunked``, the student's own perplexity of the same tokens read in chunks of the teacher's
  positions, with ``long_context_ratio`` = perplexity_student / that: at most 1, the student reads a long window at
  least as well as it reads the same tokens in teacher-length pieces (it uses the longer context instead of breaking
  on it); 1 exactly where the window fits. Unlike comparing the perplexity at two window lengths (other windows of
  the text), both sides of these ratios score the same tokens.
- ``fidelity_long_niah``: single-key NIAH in the fidelity suite's held-out phrasings and haystack sources at 16K, 32K
  and 64K (prompt lengths 16376, 32760, 65528: 8 positions left for the answer). The haystack of a source that holds
  fewer than 9/8 of the prompt length in tokens goes on with the held-out sources after it (manifest order, wrapping
  around) until it does (the row's note names them). ``accuracy_student`` at every length (a student with learned
  position embeddings stops at its positions); ``accuracy_teacher`` where the prompt fits the teacher's positions,
  else status "not_applicable" (``teacher_beyond_positions=True`` runs the teacher there anyway, noted).

The student's ``max_position_embeddings`` is not a limit here: a hybrid keeps its teacher's number as a record and
runs at any length (RoPE and the log-length scale are computed for any position); only learned position embeddings
end a model's positions (``headscope.evaluate.runtime.position_limit``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from headscope.evaluate.fidelity import (TEXT_METRICS, _check_phrasings, _check_sources, _positive_int, _shipped,
                                         _skip, _teacher, _windows, model_positions)
from headscope.evaluate.fidelity_data import load_sources, source_path
from headscope.evaluate.fidelity_decoding import window_agreement
from headscope.evaluate.rows import row
from headscope.evaluate.runtime import ANSWER_ROOM, BudgetExceeded, EvalContext, fewer_rows_after_oom, position_limit
from headscope.evaluate.teacher_cache import cached, rows_complete, tokenizer_digest

__all__ = ["FidelityLongTextConfig", "FidelityLongNiahConfig", "fidelity_long_text", "fidelity_long_niah",
           "long_haystack", "sequence_nll", "chunked_nll", "NOT_APPLICABLE", "HAYSTACK_MARGIN"]

NOT_APPLICABLE = "not_applicable"  # the status of a teacher row past the teacher's positions
HAYSTACK_MARGIN = 1.125  # a NIAH haystack holds at least this many times the prompt length in tokens
_CHUNK_ELEMENTS = 1 << 22  # float32 log-softmax rows at once: positions x vocab (16 MiB)
CHUNKED_METRICS = ("perplexity_teacher_chunked", "perplexity_ratio_chunked", "perplexity_student_chunked",
                   "long_context_ratio")


def _lengths(name: str, v) -> tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = (v,)
    if not v or any(isinstance(x, bool) or not isinstance(x, int) or x < 32 for x in v):
        raise ValueError(f"{name}={v!r}: give lengths >= 32 (tokens)")
    return tuple(sorted(set(v)))


@dataclass(frozen=True)
class FidelityLongTextConfig:
    sources: tuple[str, ...] = ()  # held-out source names (sources.json) or UTF-8 text files; (): every shipped one
    lengths: tuple[int, ...] = (8192, 16384, 32768)  # window lengths (tokens scored per window)
    n_windows: int = 2  # windows per source and length, spread evenly over its text (fewer when it is short)

    def __post_init__(self):
        _check_sources(self)
        object.__setattr__(self, "lengths", _lengths("lengths", self.lengths))
        _positive_int("n_windows", self.n_windows)


@dataclass(frozen=True)
class FidelityLongNiahConfig:
    sources: tuple[str, ...] = ()  # haystack sources; (): every shipped one
    phrasings: tuple[str, ...] = ("code", "pin", "plain")  # needle phrasings (headscope.evaluate.phrasings)
    lengths: tuple[int, ...] = (16384 - ANSWER_ROOM, 32768 - ANSWER_ROOM, 65536 - ANSWER_ROOM)  # prompt lengths
    n: int = 2  # prompts per (length, phrasing, source), needle depths spread evenly (42 prompts a length by default)
    teacher_beyond_positions: bool = False  # True: the teacher also runs past its positions (RoPE teachers), noted

    def __post_init__(self):
        _check_sources(self)
        _positive_int("n", self.n)
        _check_phrasings(self.phrasings)
        object.__setattr__(self, "lengths", _lengths("lengths", self.lengths))
        if not isinstance(self.teacher_beyond_positions, bool):
            raise ValueError(f"teacher_beyond_positions={self.teacher_beyond_positions!r}: give true or false")


# ---- forward passes --------------------------------------------------------------------------------------------
def _nll_rows(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x  # [b, T+1]`` -> per-position NLL of ``x[:, 1:]`` under ``model`` reading ``x[:, :-1]``: ``[b, T]``
    (float32, CPU; the log-softmax one chunk of positions at a time)."""
    dev = next(model.parameters()).device
    inp = x[:, :-1].to(dev)  # [b, T]
    logits = model(input_ids=inp, attention_mask=torch.ones_like(inp), use_cache=False).logits  # [b, T, V]
    tgt = x[:, 1:].to(logits.device)  # [b, T]
    out = torch.empty(tgt.shape)  # [b, T]
    chunk = max(1, _CHUNK_ELEMENTS // logits.shape[-1])
    for b in range(x.shape[0]):
        for c in range(0, tgt.shape[1], chunk):
            lp = F.log_softmax(logits[b, c:c + chunk].float(), -1)  # [c, V]
            out[b, c:c + chunk] = -lp.gather(-1, tgt[b, c:c + chunk, None])[:, 0].cpu()
    return out


@torch.no_grad()
def sequence_nll(model: nn.Module, windows: torch.Tensor, ctx: EvalContext, desc: str = "nll") -> torch.Tensor:
    """``windows  # [N, T+1]`` -> the per-position NLL ``[N, T]`` of each window read whole (one forward per batch of
    ``ctx.rows_per_batch`` rows). Raises ``BudgetExceeded`` between batches once the budget is spent."""
    N, T1 = windows.shape
    out = torch.empty(N, T1 - 1)  # [N, T]
    step = ctx.rows_per_batch(T1)
    for s in range(0, N, step):
        ctx.check_budget(f"{desc} (windows {s + 1}.. of {N})")
        out[s:s + step] = _nll_rows(model, windows[s:s + step])
    return out


@torch.no_grad()
def chunked_nll(model: nn.Module, windows: torch.Tensor, positions: int, ctx: EvalContext,
                desc: str = "chunked nll") -> torch.Tensor:
    """``windows  # [N, T+1]`` -> the per-position NLL ``[N, T]`` with the window read in consecutive chunks of
    ``positions`` tokens, each from an empty context (chunk k predicts tokens ``k*P+1 .. (k+1)*P``): what a model of
    ``positions`` positions scores on the same tokens. ``positions >= T``: ``sequence_nll``."""
    N, T1 = windows.shape
    T = T1 - 1
    if positions >= T:
        return sequence_nll(model, windows, ctx, desc)
    out = torch.empty(N, T)  # [N, T]
    for c in range(0, T, positions):
        part = windows[:, c:min(T, c + positions) + 1]  # [N, <= P+1]
        out[:, c:c + part.shape[1] - 1] = sequence_nll(model, part, ctx, f"{desc} (tokens {c + 1}..)")
    return out


def _ppl(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean()))


# ---- fidelity_long_text -----------------------------------------------------------------------------------------
def fidelity_long_text(model, tokenizer, cfg: FidelityLongTextConfig, ctx: EvalContext, teacher=None) -> list[dict]:
    """Per held-out source and window length: the student's perplexity; the teacher's (and KL, top-1 agreement)
    where the window fits its positions, "not_applicable" past them; the teacher's chunked perplexity everywhere."""
    from headscope.tasks.haystack import tokenize_text

    teacher = _teacher(teacher, "fidelity_long_text")
    device = next(model.parameters()).device
    P = model_positions(teacher)
    limit = position_limit(model)
    rows: list[dict] = []
    for name, text in load_sources(cfg.sources):
        ids = tokenize_text(tokenizer, text)  # [N]
        for W in cfg.lengths:
            fields = {"family": name, "context_length": W}
            metrics = TEXT_METRICS + CHUNKED_METRICS
            windows = _windows(ids, W + 1, cfg.n_windows)  # [n, W+1]
            why = None
            if limit is not None and W > limit:
                why = f"{W}-token windows exceed the student's {limit} learned positions"
            elif windows is None:
                why = f"the text has {len(ids)} tokens, too few for one {W}-token window"
            elif ctx.over_budget():
                why = ctx.budget_note(f"fidelity_long_text on {name} at {W}")
            if why:
                rows += _skip("fidelity_long_text", metrics, why, **fields)
                continue
            n = len(windows)
            t0 = time.perf_counter()
            ctx.log(f"fidelity_long_text {name} @{W}: start ({n} windows)")
            try:
                if P is None or W <= P:  # both models over the same windows (fidelity_text's rows)
                    st = fewer_rows_after_oom(lambda c: window_agreement(model, teacher, windows, c,
                                                                         desc=f"fidelity_long {name} @{W}"),
                                              ctx, windows.shape[1], device)
                    ppl_s, ppl_t = _ppl(st["nll_student"]), _ppl(st["nll_teacher"])
                    rows += [row("fidelity_long_text", "perplexity_student", ppl_s, n, **fields),
                             row("fidelity_long_text", "perplexity_teacher", ppl_t, n, **fields),
                             row("fidelity_long_text", "perplexity_ratio", ppl_s / ppl_t, n, **fields),
                             row("fidelity_long_text", "kl_to_teacher", float(st["kl"].double().mean()), n, **fields),
                             row("fidelity_long_text", "top1_agreement", float(st["agree"].double().mean()), n,
                                 **fields)]
                    note = "the window fits the teacher's positions: one chunk, the teacher's own perplexity"
                    rows += [row("fidelity_long_text", "perplexity_teacher_chunked", ppl_t, n, note=note, **fields),
                             row("fidelity_long_text", "perplexity_ratio_chunked", ppl_s / ppl_t, n, note=note,
                                 **fields),
                             row("fidelity_long_text", "perplexity_student_chunked", ppl_s, n, note=note, **fields),
                             row("fidelity_long_text", "long_context_ratio", 1.0, n, note=note, **fields)]
                else:  # past the teacher's positions: the student alone, the teacher in chunks of its positions
                    nll_s = fewer_rows_after_oom(lambda c: sequence_nll(model, windows, c, f"student {name} @{W}"),
                                                 ctx, windows.shape[1], device)
                    def teacher_ppl() -> float:  # the teacher's side alone: kept by a teacher cache
                        return _ppl(fewer_rows_after_oom(lambda c: chunked_nll(teacher, windows, P, c,
                                                                               f"teacher {name} @{W}"),
                                                         ctx, P + 1, device))

                    digest = hashlib.sha256(windows.numpy().tobytes()).hexdigest()
                    ppl_t = cached(ctx, "chunked_ppl", {"windows": digest, "positions": P}, teacher_ppl)
                    nll_sc = fewer_rows_after_oom(lambda c: chunked_nll(model, windows, P, c,
                                                                        f"student in chunks {name} @{W}"),
                                                  ctx, P + 1, device)
                    ppl_s, ppl_sc = _ppl(nll_s), _ppl(nll_sc)
                    na = (f"{W}-token windows are past the teacher's {P} positions: no teacher score at this length "
                          "(perplexity_teacher_chunked: the teacher on the same tokens in chunks of its positions)")
                    rows.append(row("fidelity_long_text", "perplexity_student", ppl_s, n, **fields))
                    rows += _skip("fidelity_long_text", TEXT_METRICS[1:], na, status=NOT_APPLICABLE, **fields)
                    note = f"the teacher reads the window in chunks of {P} tokens, each from an empty context"
                    rows += [row("fidelity_long_text", "perplexity_teacher_chunked", ppl_t, n, note=note, **fields),
                             row("fidelity_long_text", "perplexity_ratio_chunked", ppl_s / ppl_t, n, note=note,
                                 **fields)]
                    note = (f"the student reads the same tokens in chunks of the teacher's {P} positions, each from "
                            "an empty context")
                    rows += [row("fidelity_long_text", "perplexity_student_chunked", ppl_sc, n, note=note, **fields),
                             row("fidelity_long_text", "long_context_ratio", ppl_s / ppl_sc, n, note=note, **fields)]
            except BudgetExceeded:
                rows += _skip("fidelity_long_text", metrics, ctx.budget_note(f"fidelity_long_text on {name} at {W}"),
                              **fields)
                continue
            ctx.log(f"fidelity_long_text {name} @{W}: done in {time.perf_counter() - t0:.1f} s")
    return rows


# ---- fidelity_long_niah -----------------------------------------------------------------------------------------
def long_haystack(name: str, order: list[tuple[str, str]], tokens: dict[str, int], length: int,
                  margin: float = HAYSTACK_MARGIN) -> tuple[str, list[str]]:
    """(haystack text, the sources it holds) for a ``length``-token prompt on source ``name``: the source alone when
    it holds ``margin`` x ``length`` tokens, else followed by the sources after it in ``order`` (``[(name, text)]``,
    all held-out text; wrapping around to the first) until it does, joined by blank lines (all of them if even that
    is short: the task then wraps around the text). ``tokens``: each source's token count."""
    names = [n for n, _ in order]
    texts = dict(order)
    k = names.index(name)
    used, total = [name], tokens[name]
    for other in names[k + 1:] + names[:k]:
        if total >= margin * length:
            break
        used.append(other)
        total += tokens[other]
    return "\n\n".join(texts[n].strip() for n in used) + "\n", used


def fidelity_long_niah(model, tokenizer, cfg: FidelityLongNiahConfig, ctx: EvalContext, teacher=None) -> list[dict]:
    """Single-key NIAH in held-out phrasings and haystacks at lengths past the teacher's: the student at every
    length, the teacher where the prompt fits its positions ("not_applicable" past them)."""
    from headscope.evaluate.retrieval import _cell_seed, by_length
    from headscope.tasks.haystack import tokenize_text

    teacher = _teacher(teacher, "fidelity_long_niah")
    names = [source_path(s)[0] for s in (cfg.sources or _shipped())]
    extra = [s for s in _shipped() if s not in names]  # more held-out text to extend a short haystack with
    order = load_sources(tuple(cfg.sources or _shipped()) + tuple(extra))  # [(name, text)], the chosen ones first
    tokens = {n: len(tokenize_text(tokenizer, t)) for n, t in order}
    hay = {(n, L): long_haystack(n, order, tokens, L) for n in names for L in cfg.lengths}
    combos = [(p, n) for p in cfg.phrasings for n in names]

    def note_of(n: str, L: int) -> str | None:
        used = hay[(n, L)][1]
        if len(used) == 1:
            return None
        return (f"haystack: {' + '.join(used)} ({n} alone has {tokens[n]:,} tokens, fewer than "
                f"{HAYSTACK_MARGIN:g} x {L})")

    def cells(L):
        return [({"context_length": L, "phrasing": p, "family": f"{p}+{n}"}, "niah_phrased",
                 {"context_length": L, "depth": "uniform", "haystack": hay[(n, L)][0], "phrasing": p}, cfg.n,
                 _cell_seed(ctx.seed, L, 300 + i)) for i, (p, n) in enumerate(combos)]

    P = model_positions(teacher)
    fits = [L for L in cfg.lengths if P is None or L + ANSWER_ROOM <= P or cfg.teacher_beyond_positions]
    rows: list[dict] = []
    key = {"config": dataclasses.asdict(cfg), "lengths": fits, "seed": ctx.seed,
           "tokenizer": tokenizer_digest(tokenizer),
           "haystacks": {f"{n}@{L}": hashlib.sha256(h[0].encode()).hexdigest() for (n, L), h in hay.items()}}
    sides = (("student", lambda: by_length(model, tokenizer, ctx, "fidelity_long_niah", list(cfg.lengths), cells,
                                           True)),
             ("teacher", lambda: cached(ctx, "long_niah", key,  # rows cut short are not kept
                                        lambda: by_length(teacher, tokenizer, ctx, "fidelity_long_niah", fits, cells,
                                                          True),
                                        keep=rows_complete)))
    for who, side in sides:
        for r in side():
            if r["metric"] != "accuracy":
                continue
            L = int(r["context_length"])
            notes = [r["note"], note_of(r["family"].split("+", 1)[1], L)]
            if who == "teacher" and P is not None and L + ANSWER_ROOM > P:
                notes.append(f"past the teacher's {P} positions (teacher_beyond_positions=True)")
            rows.append({**r, "metric": f"accuracy_{who}", "note": "; ".join(x for x in notes if x) or None})
    na = [L for L in cfg.lengths if L not in fits]
    for L in na:
        why = (f"{L}-token prompts + {ANSWER_ROOM} answer tokens are past the teacher's {P} positions: no teacher "
               "score at this length (teacher_beyond_positions=True runs it anyway)")
        for fields, *_ in cells(L):
            rows.append(row("fidelity_long_niah", "accuracy_teacher", None, 0, status=NOT_APPLICABLE, note=why,
                            **fields))
    return rows
