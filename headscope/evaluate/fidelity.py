"""Fidelity to the teacher: how close a student (a hybrid) stays to its teacher on text neither was trained on.

    df = headscope.evaluate(student, suite="fidelity", teacher=teacher, tokenizer=tok)
    headscope eval --model STUDENT --teacher TEACHER --suite fidelity --out DIR

Four evaluations (each registered with ``needs_teacher=True``; ``family`` is the held-out source):

- ``fidelity_text``: windows of each held-out source through both models, one forward each:
  ``perplexity_student``, ``perplexity_teacher``, ``perplexity_ratio`` (student / teacher), ``kl_to_teacher``
  (mean per-token KL(teacher || student), nats, float32 log-softmax) and ``top1_agreement`` (share of positions
  where both argmaxes agree);
- ``fidelity_continuation``: greedy continuations (32 new tokens) of held-out prefixes by both models:
  ``continuation_agreement`` = tokens equal to the teacher's before the first difference / new tokens, mean per
  source (``continuation_agreement_std``: its spread);
- ``fidelity_chat``: both models answer held-out instructions greedily (the tokenizer's chat template);
  ``chat_nll_ratio`` = the teacher's mean per-token NLL of the student's answer / that of its own answer (mean
  over instructions; ``chat_nll_ratio_median``); the answers side by side go to ``chat_answers.jsonl`` in the
  result folder. Without a chat template: "skipped" rows;
- ``fidelity_niah``: single-key NIAH in phrasings and haystack sources that no training row uses, for the
  student (``accuracy_student``) and the teacher (``accuracy_teacher``), by length; ``family`` is
  "<phrasing>+<source>". A length past either model's positions gives "skipped" rows saying so.

The teacher against itself gives exactly ``perplexity_ratio`` 1, ``kl_to_teacher`` 0, ``top1_agreement`` 1,
``continuation_agreement`` 1 and ``chat_nll_ratio`` 1: both run the same batches in the same order.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from headscope.evaluate.engine import pad_id_of
from headscope.evaluate.fidelity_data import load_instructions, load_sources, source_path
from headscope.evaluate.fidelity_decoding import answer_nll, greedy_continuations, window_agreement
from headscope.evaluate.lengths import configured_positions
from headscope.evaluate.rows import row
from headscope.evaluate.runtime import ANSWER_ROOM, BudgetExceeded, EvalContext, fewer_rows_after_oom, position_limit
from headscope.evaluate.teacher_cache import cached, rows_complete, tokenizer_digest

__all__ = ["FidelityTextConfig", "ContinuationConfig", "ChatConfig", "FidelityNiahConfig", "MissingTeacherError",
           "fidelity_text", "fidelity_continuation", "fidelity_chat", "fidelity_niah", "nll_ratios",
           "repeated_ngrams", "model_positions", "chat_tokenizer", "check_teacher", "ANSWERS_FILE"]

ANSWERS_FILE = "chat_answers.jsonl"  # the side-by-side chat answers, written beside results.json
TEXT_METRICS = ("perplexity_student", "perplexity_teacher", "perplexity_ratio", "kl_to_teacher", "top1_agreement")
CHAT_METRICS = ("chat_nll_ratio", "chat_nll_ratio_median")


class MissingTeacherError(ValueError):
    """An evaluation that compares the model with its teacher, asked for without one."""


def _positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r}: give an int >= 1")


def _check_sources(cfg) -> None:
    """Sources as a tuple of strings, each a known name or an existing file (checked before any work)."""
    if isinstance(cfg.sources, (str, os.PathLike)):
        object.__setattr__(cfg, "sources", (cfg.sources,))
    srcs = tuple(str(s) if isinstance(s, os.PathLike) else s for s in cfg.sources)
    for s in srcs:
        source_path(s)
    object.__setattr__(cfg, "sources", srcs)


def _check_phrasings(phrasings) -> None:
    """Needle phrasings: a non-empty tuple of names of headscope.evaluate.phrasings.PHRASINGS."""
    from headscope.evaluate.phrasings import PHRASINGS

    bad = [p for p in phrasings if p not in PHRASINGS]
    if not phrasings or bad:
        raise ValueError(f"phrasings={phrasings!r}: give names from {sorted(PHRASINGS)}")


@dataclass(frozen=True)
class FidelityTextConfig:
    sources: tuple[str, ...] = ()  # held-out source names (sources.json) or UTF-8 text files; (): every shipped one
    window: int = 2048  # tokens per window (each position scored)
    n_windows: int = 16  # windows per source, spread evenly over its text (fewer when the text is short)

    def __post_init__(self):
        _check_sources(self)
        _positive_int("window", self.window)
        _positive_int("n_windows", self.n_windows)


@dataclass(frozen=True)
class ContinuationConfig:
    sources: tuple[str, ...] = ()
    prefix: int = 256  # tokens of held-out text before the continuation
    new_tokens: int = 32  # greedy tokens per continuation (the agreement's denominator)
    n: int = 32  # prefixes per source, spread evenly over its text

    def __post_init__(self):
        _check_sources(self)
        for name in ("prefix", "new_tokens", "n"):
            _positive_int(name, getattr(self, name))


@dataclass(frozen=True)
class ChatConfig:
    instructions: str = "chat_heldout"  # a JSONL instruction set: a manifest name or a path
    n: int = 0  # instructions used (the first n); 0: all
    max_new_tokens: int = 128  # greedy answer tokens at most (an answer ends at an end-of-text/turn token)

    def __post_init__(self):
        source_path(self.instructions, suffix=".jsonl")
        _positive_int("max_new_tokens", self.max_new_tokens)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 0:
            raise ValueError(f"n={self.n!r}: give an int >= 0 (0: every instruction)")


@dataclass(frozen=True)
class FidelityNiahConfig:
    sources: tuple[str, ...] = ()  # haystack sources; (): every shipped one
    phrasings: tuple[str, ...] = ("code", "pin", "plain")  # needle phrasings (headscope.evaluate.phrasings)
    lengths: tuple[int, ...] = (2048 - ANSWER_ROOM, 4096 - ANSWER_ROOM, 6144 - ANSWER_ROOM, 8192 - ANSWER_ROOM)
    n: int = 8  # prompts per (length, phrasing, source), needle depths spread evenly
    beyond_positions: bool = False  # True: also lengths past a model's positions (RoPE models run there)

    def __post_init__(self):
        _check_sources(self)
        _positive_int("n", self.n)
        _check_phrasings(self.phrasings)
        if not self.lengths or any(isinstance(x, bool) or not isinstance(x, int) or x < 32 for x in self.lengths):
            raise ValueError(f"lengths={self.lengths!r}: give prompt lengths >= 32 (tokens)")


def check_teacher(cfgs, teacher) -> list[str]:
    """The planned evaluations (``[(name, config)]``) that compare the model with a teacher; a
    ``MissingTeacherError`` naming them when some do and ``teacher`` is None."""
    from headscope.evaluate.registry import get_evaluation

    need = [n for n, _ in cfgs if get_evaluation(n).needs_teacher]
    if need and teacher is None:
        raise MissingTeacherError(f"evaluation(s) {need} compare the model with its teacher: pass teacher= (Python: "
                                  "a model, or a name/folder such as 'default') or --teacher TEACHER (command line)")
    return need


def _teacher(teacher, evaluation: str):
    if teacher is None:
        raise MissingTeacherError(f"evaluation {evaluation!r} compares the model with its teacher: pass teacher= "
                                  "(Python: a model, or a name/folder such as 'default') or --teacher (command line)")
    return teacher


def model_positions(model) -> int | None:
    """The positions a model has: its learned position embeddings, else its config's max_position_embeddings
    (RoPE models run past it, whatever they score), else None."""
    limit = position_limit(model)
    return limit if limit is not None else configured_positions(model)


def _past_positions(student, teacher, tokens: int, what: str) -> str | None:
    """Why ``tokens`` (``what``: "256-token windows") do not fit the student or the teacher, or None."""
    for who, m in (("student", student), ("teacher", teacher)):
        p = model_positions(m)
        if p is not None and tokens > p:
            return f"{what} exceed the {who}'s {p} positions"
    return None


def _windows(ids: torch.Tensor, length: int, n: int) -> torch.Tensor | None:
    """Up to ``n`` non-overlapping windows of ``length`` tokens spread evenly over ``ids  # [N]`` -> ``[W, length]``."""
    n = min(n, len(ids) // length)
    if n < 1:
        return None
    stride = (len(ids) - length) // max(1, n - 1) if n > 1 else 0
    return torch.stack([ids[i * stride: i * stride + length] for i in range(n)])  # [W, length]


def _skip(evaluation: str, metrics, note: str, status: str = "skipped", **fields) -> list[dict]:
    return [row(evaluation, m, None, 0, status=status, note=note, **fields) for m in metrics]


def fidelity_text(model, tokenizer, cfg: FidelityTextConfig, ctx: EvalContext, teacher=None) -> list[dict]:
    """Per held-out source: both perplexities, their ratio, KL(teacher || student) and top-1 agreement, from one
    forward of each model over the same windows."""
    from headscope.tasks.haystack import tokenize_text

    teacher = _teacher(teacher, "fidelity_text")
    device = next(model.parameters()).device
    rows: list[dict] = []
    for name, text in load_sources(cfg.sources):
        fields = {"family": name, "context_length": cfg.window}
        why, windows = _past_positions(model, teacher, cfg.window, f"{cfg.window}-token windows"), None
        if why is None:
            ids = tokenize_text(tokenizer, text)  # [N]
            windows = _windows(ids, cfg.window + 1, cfg.n_windows)  # [W, window+1]
            if windows is None:
                why = f"the text has {len(ids)} tokens, too few for one {cfg.window}-token window"
        if why is None and ctx.over_budget():
            why = ctx.budget_note(f"fidelity_text on {name}")
        if why:
            rows += _skip("fidelity_text", TEXT_METRICS, why, **fields)
            continue
        t0 = time.perf_counter()
        ctx.log(f"fidelity_text {name}: start ({len(windows)} windows of {cfg.window} tokens)")
        try:
            st = fewer_rows_after_oom(lambda c: window_agreement(model, teacher, windows, c, desc=f"fidelity {name}"),
                                      ctx, windows.shape[1], device)
        except BudgetExceeded:
            rows += _skip("fidelity_text", TEXT_METRICS, ctx.budget_note(f"fidelity_text on {name}"), **fields)
            continue
        W = len(windows)
        ppl_s, ppl_t = math.exp(float(st["nll_student"].double().mean())), math.exp(float(
            st["nll_teacher"].double().mean()))
        rows += [row("fidelity_text", "perplexity_student", ppl_s, W, **fields),
                 row("fidelity_text", "perplexity_teacher", ppl_t, W, **fields),
                 row("fidelity_text", "perplexity_ratio", ppl_s / ppl_t, W, **fields),
                 row("fidelity_text", "kl_to_teacher", float(st["kl"].double().mean()), W, **fields),
                 row("fidelity_text", "top1_agreement", float(st["agree"].double().mean()), W, **fields)]
        ctx.log(f"fidelity_text {name}: done in {time.perf_counter() - t0:.1f} s")
    return rows


def _agreement(student: list[int], teacher: list[int], new_tokens: int) -> float:
    """Tokens equal to the teacher's before the first difference, / new_tokens."""
    k = 0
    for a, b in zip(student, teacher):
        if a != b:
            break
        k += 1
    return k / new_tokens


def fidelity_continuation(model, tokenizer, cfg: ContinuationConfig, ctx: EvalContext, teacher=None) -> list[dict]:
    """Per held-out source: how many greedy tokens the student shares with the teacher before they part."""
    from headscope.tasks.haystack import tokenize_text

    teacher = _teacher(teacher, "fidelity_continuation")
    metrics = ("continuation_agreement", "continuation_agreement_std")
    pad = pad_id_of(tokenizer)
    rows: list[dict] = []
    for name, text in load_sources(cfg.sources):
        fields = {"family": name, "context_length": cfg.prefix}
        why, spans = _past_positions(model, teacher, cfg.prefix + cfg.new_tokens,
                                     f"{cfg.prefix}-token prefixes + {cfg.new_tokens} new tokens"), None
        if why is None:
            ids = tokenize_text(tokenizer, text)  # [N]
            spans = _windows(ids, cfg.prefix + cfg.new_tokens, cfg.n)  # [P, prefix + new]
            if spans is None:
                why = f"the text has {len(ids)} tokens, too few for one {cfg.prefix}-token prefix"
        if why is None and ctx.over_budget():
            why = ctx.budget_note(f"fidelity_continuation on {name}")
        if why:
            rows += _skip("fidelity_continuation", metrics, why, **fields)
            continue
        prompts = [s[:cfg.prefix].tolist() for s in spans]
        t0 = time.perf_counter()
        ctx.log(f"fidelity_continuation {name}: start ({len(prompts)} prefixes, {cfg.new_tokens} new tokens)")
        try:
            gen_t = cached(ctx, "continuation", {"source": name, "prompts": prompts, "new": cfg.new_tokens, "pad": pad},
                           lambda: greedy_continuations(teacher, prompts, cfg.new_tokens, ctx, pad_id=pad,
                                                        desc=f"teacher {name}"))
            gen_s = greedy_continuations(model, prompts, cfg.new_tokens, ctx, pad_id=pad, desc=f"student {name}")
        except BudgetExceeded:
            rows += _skip("fidelity_continuation", metrics, ctx.budget_note(f"fidelity_continuation on {name}"),
                          **fields)
            continue
        agree = [_agreement(s, t, cfg.new_tokens) for s, t in zip(gen_s, gen_t)]
        rows += [row("fidelity_continuation", "continuation_agreement", statistics.fmean(agree), len(agree),
                     prompt_tokens=cfg.prefix, **fields),
                 row("fidelity_continuation", "continuation_agreement_std", statistics.pstdev(agree), len(agree),
                     prompt_tokens=cfg.prefix, **fields)]
        ctx.log(f"fidelity_continuation {name}: done in {time.perf_counter() - t0:.1f} s")
    return rows


def chat_tokenizer(tokenizer, teacher) -> Any | None:
    """The tokenizer whose chat template builds the prompts: the one given if it has a template, else the one
    saved with the teacher if it has one (and the same vocabulary), else None."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer
    from headscope.tokenizers import find_tokenizer

    try:
        other = find_tokenizer(teacher, None, required=False)
    except Exception:  # noqa: BLE001 - no tokenizer beside the teacher: no template
        return None
    if other is None or not getattr(other, "chat_template", None):
        return None
    return other if other.get_vocab() == tokenizer.get_vocab() else None


def _stop_ids(tok, teacher) -> set[int]:
    out = {tok.eos_token_id} if isinstance(tok.eos_token_id, int) else set()
    gen = getattr(getattr(teacher, "generation_config", None), "eos_token_id", None)
    out |= {gen} if isinstance(gen, int) else {x for x in (gen or ()) if isinstance(x, int)}
    return out


def nll_ratios(nll_student_answers, nll_teacher_answers) -> tuple[list[float | None], int]:
    """Per instruction, the teacher's NLL of the student's answer / of its own answer; ``None`` where the
    teacher's own answer has NLL 0 (no ratio). Returns (ratios, number left out)."""
    out: list[float | None] = []
    for s, t in zip(nll_student_answers, nll_teacher_answers, strict=True):
        out.append(None if t <= 0 else s / t)
    return out, sum(r is None for r in out)


LOOP_SHARE = 0.3  # an answer repeating more than this share of its 4-grams loops (chat_nll_ratio_no_loops)


def repeated_ngrams(tokens: Sequence[int], n: int = 4) -> float:
    """The share of an answer's token n-grams that already occurred earlier in it (0 for a loop-free answer, near 1
    for one that repeats a phrase to its end); 0 for answers shorter than n + 1 tokens. The teacher's NLL rewards
    such loops (each repeat is easy to predict), so ``chat_nll_ratio`` is read beside it."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if len(grams) < 2:
        return 0.0
    seen, again = set(), 0
    for g in grams:
        again += g in seen
        seen.add(g)
    return again / len(grams)


def fidelity_chat(model, tokenizer, cfg: ChatConfig, ctx: EvalContext, teacher=None) -> list[dict]:
    """The teacher's NLL of the student's greedy answers relative to its own, over held-out instructions."""
    teacher = _teacher(teacher, "fidelity_chat")
    name, _ = source_path(cfg.instructions, suffix=".jsonl")
    fields = {"family": name}
    tok = chat_tokenizer(tokenizer, teacher)
    if tok is None:
        return _skip("fidelity_chat", CHAT_METRICS, "the tokenizer has no chat template (a base model, such as the "
                     "reference model): chat_nll_ratio needs a chat-tuned teacher's tokenizer", **fields)
    if ctx.over_budget():
        return _skip("fidelity_chat", CHAT_METRICS, ctx.budget_note("fidelity_chat"), **fields)
    items = load_instructions(cfg.instructions)
    items = items[: cfg.n] if cfg.n else items
    prompts = []
    for it in items:
        text = tok.apply_chat_template([{"role": "user", "content": it["instruction"]}], tokenize=False,
                                       add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    pad, stop = pad_id_of(tokenizer), _stop_ids(tok, teacher)
    t0 = time.perf_counter()
    ctx.log(f"fidelity_chat: start ({len(prompts)} instructions, up to {cfg.max_new_tokens} answer tokens)")
    try:
        def teacher_side() -> dict:
            answers = greedy_continuations(teacher, prompts, cfg.max_new_tokens, ctx, pad_id=pad, stop_ids=stop,
                                           desc="chat: teacher")
            return {"answers": answers,
                    "nll": answer_nll(teacher, prompts, answers, ctx, pad_id=pad, desc="chat: teacher's answers")}

        own = cached(ctx, "chat", {"prompts": prompts, "new": cfg.max_new_tokens, "pad": pad, "stop": sorted(stop)},
                     teacher_side)
        ans_t, nll_t = own["answers"], own["nll"]
        ans_s = greedy_continuations(model, prompts, cfg.max_new_tokens, ctx, pad_id=pad, stop_ids=stop,
                                     desc="chat: student")
        diff = [i for i in range(len(items)) if ans_s[i] != ans_t[i]]  # equal answers: the same NLL, exactly
        part = answer_nll(teacher, [prompts[i] for i in diff], [ans_s[i] for i in diff], ctx, pad_id=pad,
                          desc="chat: student's answers") if diff else []
    except BudgetExceeded:
        return _skip("fidelity_chat", CHAT_METRICS, ctx.budget_note("fidelity_chat"), **fields)
    nll_s = list(nll_t)
    for i, v in zip(diff, part):
        nll_s[i] = v
    ratios, left_out = nll_ratios(nll_s, nll_t)
    kept = [r for r in ratios if r is not None]
    note = f"{left_out} instruction(s) left out: the teacher's own answer had NLL 0" if left_out else None
    n = len(kept)
    rep_s, rep_t = [repeated_ngrams(a) for a in ans_s], [repeated_ngrams(a) for a in ans_t]
    # the ratio where neither answer loops: a loop is easy for the teacher to predict, so fewer loops can raise the
    # mean ratio while the answers get better; this one compares like with like
    calm = [r for r, g_s, g_t in zip(ratios, rep_s, rep_t)
            if r is not None and g_s <= LOOP_SHARE and g_t <= LOOP_SHARE]
    rows = [row("fidelity_chat", "chat_nll_ratio", statistics.fmean(kept) if kept else None, n, note=note, **fields),
            row("fidelity_chat", "chat_nll_ratio_median", statistics.median(kept) if kept else None, n, note=note,
                **fields),
            row("fidelity_chat", "chat_nll_student_answer", statistics.fmean(nll_s), len(nll_s), **fields),
            row("fidelity_chat", "chat_nll_teacher_answer", statistics.fmean(nll_t), len(nll_t), **fields),
            row("fidelity_chat", "chat_same_answer", 1 - len(diff) / len(items), len(items), **fields),
            row("fidelity_chat", "chat_repeated_4grams_student", statistics.fmean(rep_s), len(rep_s), **fields),
            row("fidelity_chat", "chat_repeated_4grams_teacher", statistics.fmean(rep_t), len(rep_t), **fields),
            row("fidelity_chat", "chat_nll_ratio_no_loops", statistics.fmean(calm) if calm else None, len(calm),
                note=None if calm else f"every answer pair has a loop (> {LOOP_SHARE:g} of its 4-grams repeated)",
                **fields)]
    if ctx.artifacts is not None:
        ctx.artifacts[ANSWERS_FILE] = [
            {**it, "teacher_answer": tok.decode(a_t, skip_special_tokens=True),
             "student_answer": tok.decode(a_s, skip_special_tokens=True), "nll_teacher_answer": v_t,
             "nll_student_answer": v_s, "ratio": r, "teacher_tokens": len(a_t), "student_tokens": len(a_s),
             "teacher_repeated_4grams": g_t, "student_repeated_4grams": g_s}
            for it, a_t, a_s, v_t, v_s, r, g_t, g_s in zip(items, ans_t, ans_s, nll_t, nll_s, ratios, rep_t, rep_s)]
    ctx.log(f"fidelity_chat: done in {time.perf_counter() - t0:.1f} s")
    return rows


def fidelity_niah(model, tokenizer, cfg: FidelityNiahConfig, ctx: EvalContext, teacher=None) -> list[dict]:
    """NIAH accuracy of the student and of the teacher in held-out phrasings x haystack sources, by length."""
    from headscope.evaluate.retrieval import _cell_seed, by_length

    teacher = _teacher(teacher, "fidelity_niah")
    sources = [source_path(s) for s in (cfg.sources or _shipped())]
    combos = [(p, name, path) for p in cfg.phrasings for name, path in sources]

    def cells(L):
        return [({"context_length": L, "phrasing": p, "family": f"{p}+{name}"}, "niah_phrased",
                 {"context_length": L, "depth": "uniform", "haystack": str(path), "phrasing": p}, cfg.n,
                 _cell_seed(ctx.seed, L, 200 + i)) for i, (p, name, path) in enumerate(combos)]

    run, rows = [], []
    for L in sorted(set(cfg.lengths)):
        why = _past_positions(model, teacher, L + ANSWER_ROOM, f"{L}-token prompts + {ANSWER_ROOM} answer tokens")
        if why and not cfg.beyond_positions:
            note = why + "; not run (beyond_positions=True runs it on RoPE models)"
            rows += [row("fidelity_niah", m, None, 0, status="skipped", note=note, **fields)
                     for fields, *_ in cells(L) for m in ("accuracy_student", "accuracy_teacher")]
        else:
            run.append(L)
    def teacher_rows() -> list[dict]:
        return by_length(teacher, tokenizer, ctx, "fidelity_niah", run, cells, True)

    key = {"config": dataclasses.asdict(cfg), "lengths": run, "seed": ctx.seed,
           "tokenizer": tokenizer_digest(tokenizer),
           "haystacks": [(name, hashlib.sha256(Path(path).read_bytes()).hexdigest()) for name, path in sources]}
    sides = (("student", lambda: by_length(model, tokenizer, ctx, "fidelity_niah", run, cells, True)),
             ("teacher", lambda: cached(ctx, "niah", key, teacher_rows,  # rows cut short are not kept
                                        keep=rows_complete)))
    for who, side in sides:
        for r in side():
            if r["metric"] != "accuracy":
                continue
            L = int(r["context_length"])
            why = _past_positions(model, teacher, L + ANSWER_ROOM, f"{L}-token prompts + {ANSWER_ROOM} answer tokens")
            if why and r["note"] is None:
                r["note"] = why + " (run with beyond_positions=True)"
            rows.append({**r, "metric": f"accuracy_{who}"})
    return rows


def _shipped() -> list[str]:
    from headscope.evaluate.fidelity_data import list_sources

    return list_sources()
