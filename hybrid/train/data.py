"""On-the-fly training batches: text windows, NIAH, multi-key NIAH, reasoning, copies, teacher samples.

A batch is a pure function of ``(seed, stage, step)``: ``MixtureStream.batch(step, progress, rows)`` seeds
the length from ``(seed, stage, step)`` and every row from ``(seed, stage, step, row)``, so the data position
of a run is its step (resume is exact), each process of a distributed run builds only its own rows, and
DataLoader workers (``StepBatches``) build whole batches of interleaved steps. ``rows`` sequences of one
length ``T`` (the length curriculum picks T per batch), each row drawn from the mixture:
- "text":      a random window of the pre-tokenized training corpus, or, for a corpus manifest
               (research.corpus.build, docs/corpus.md), of one of its sources drawn by weight
               (``hybrid.train.text``'s ``TextSources`` and ``load_text``; the teacher's cached text,
               ``teacher_corpus``, can be one more); a window never leaves its source.
               ``text_windows="documents"`` (long rows): the window starts at a document's start, inside the
               document when it is long enough, else through the source's next documents;
- "niah":      one single-key NIAH prompt + answer (haystack cfg.haystack, by default the training split;
               context ~T, depth uniform 0..1);
- "multikey":  one multi-key NIAH prompt + answer (2..6 keys), or with ``multikey_min_len`` > 0 several
               prompts of random lengths (powers of two from multikey_min_len up to T) packed into the row;
- "reasoning": short reasoning prompts + answers packed back to back, separated by <|endoftext|>;
- "copy":      a snippet (16..128 tokens: corpus text, or independent corpus tokens) repeated until the
               row is full: pure induction data, which makes copy/retrieval heads form early;
- "teacher":   a random window of text sampled from the teacher itself (``teacher_ids``; hybrid stages).
Every row carries per-token loss weights ``w  # [T]``: 1 on ordinary targets (``haystack_weight`` on the
haystack/needle/question tokens of NIAH rows), ``answer_weight`` on the positions that predict answer
tokens, 0 on padding. Targets are ``ids`` shifted by one.
"""
from __future__ import annotations

import pickle
import random
import re
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.utils.data import IterableDataset, get_worker_info

from hybrid.train.text import TextSources

KINDS = ("text", "niah", "multikey", "reasoning", "copy", "teacher")
HELDOUT_MODULUS = 7  # NIAH values divisible by 7 are never asked in training (eval reports them separately)
TEXT_WINDOWS = ("random", "documents")  # MixtureConfig.text_windows / DataConfig.text_windows


def is_heldout_value(answer: str) -> bool:
    """True for NIAH answers (" 4321") reserved for evaluation: the value is a multiple of HELDOUT_MODULUS."""
    digits = answer.strip()
    return digits.isdigit() and int(digits) % HELDOUT_MODULUS == 0


@dataclass(frozen=True)
class MixtureConfig:
    seq_len: int = 2048
    tokens_per_batch: int = 65536
    w_text: float = 0.25
    w_niah: float = 0.4
    w_multikey: float = 0.15
    w_reasoning: float = 0.2
    w_copy: float = 0.1
    w_teacher: float = 0.0  # windows of teacher-sampled text (MixtureStream's teacher_ids)
    answer_weight: float = 5.0
    min_len: int = 256  # shortest sequence of the length curriculum
    ramp: float = 0.3  # fraction of the run over which the longest length grows from min_len to seq_len
    max_keys: int = 6
    binding_vars: tuple[int, int] = (4, 4)  # binding examples bind n_vars ~ U[lo, hi] variables (task default 4)
    haystack_weight: float = 1.0  # loss weight of the prompt tokens of NIAH rows (0: train on the answers only)
    multikey_min_len: int = 0  # > 0: pack multi-key prompts of lengths multikey_min_len..T into each row
    reasoning_families: tuple[str, ...] = ("arithmetic", "binding", "comparison", "two_hop")  # repeats = weight
    extra_queries: int = 0  # multi-key NIAH and binding examples: up to this many more keys asked after the answer
    haystack: str = "train"  # NIAH haystack source (headscope.tasks.load_haystack): data/corpus/train.txt
    fast_niah: bool = False  # build NIAH prompts from token windows of the corpus (~length) instead of the task's
    #                          exact-length fitting (same templates; several times cheaper; stages 1-3 used False)
    text_only: bool = False
    # text rows: "random" (a window at a random token of the source) or "documents" (a window from a document's start:
    # long documents alone, short ones joined with the source's next documents; MixtureStream.document_window)
    text_windows: str = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "tokens_per_batch", "min_len"):
            if getattr(self, name) < 16:
                raise ValueError(f"MixtureConfig.{name} must be >= 16, got {getattr(self, name)}")
        if self.min_len > self.seq_len:
            raise ValueError(f"MixtureConfig.min_len={self.min_len} exceeds seq_len={self.seq_len}")
        if self.tokens_per_batch < self.seq_len:
            raise ValueError(f"MixtureConfig.tokens_per_batch={self.tokens_per_batch} is below seq_len={self.seq_len}")
        ws = self.weights()
        if any(w < 0 for w in ws.values()) or sum(ws.values()) <= 0:
            raise ValueError(f"MixtureConfig mixture weights must be >= 0 with a positive sum, got {ws}")
        if not 0.0 <= self.ramp <= 1.0:
            raise ValueError(f"MixtureConfig.ramp must be in [0, 1], got {self.ramp}")
        if self.max_keys < 2:
            raise ValueError(f"MixtureConfig.max_keys must be >= 2, got {self.max_keys}")
        bv = self.binding_vars
        if (not isinstance(bv, tuple) or len(bv) != 2 or not all(isinstance(x, int) for x in bv)
                or not 2 <= bv[0] <= bv[1] <= 9):
            raise ValueError(f"MixtureConfig.binding_vars={bv!r}: give (lo, hi) with 2 <= lo <= hi <= 9")
        if not 0 <= self.extra_queries <= 8:
            raise ValueError(f"MixtureConfig.extra_queries must be in [0, 8], got {self.extra_queries}")
        if self.haystack_weight < 0:
            raise ValueError(f"MixtureConfig.haystack_weight must be >= 0, got {self.haystack_weight}")
        if self.multikey_min_len and not 64 <= self.multikey_min_len <= self.seq_len:
            raise ValueError(f"MixtureConfig.multikey_min_len={self.multikey_min_len}: give 0 (one prompt per row) "
                             f"or a length in [64, seq_len={self.seq_len}]")
        if self.text_windows not in TEXT_WINDOWS:
            raise ValueError(f"MixtureConfig.text_windows={self.text_windows!r}: give one of {TEXT_WINDOWS}")
        from headscope.tasks.reasoning import FAMILIES

        fams = self.reasoning_families
        if isinstance(fams, str) or not fams or any(f not in FAMILIES for f in fams):
            raise ValueError(f"MixtureConfig.reasoning_families={fams!r}: give a non-empty tuple drawn from "
                             f"{tuple(FAMILIES)} (repeat a family to weight it)")

    def weights(self) -> dict[str, float]:
        if self.text_only:
            return {"text": 1.0, "niah": 0.0, "multikey": 0.0, "reasoning": 0.0, "copy": 0.0, "teacher": 0.0}
        return {"text": self.w_text, "niah": self.w_niah, "multikey": self.w_multikey, "reasoning": self.w_reasoning,
                "copy": self.w_copy, "teacher": self.w_teacher}


def curriculum_lengths(cfg: MixtureConfig, progress: float) -> list[int]:
    """Sequence lengths allowed at ``progress`` in [0, 1]: powers of two from min_len up to the current cap."""
    frac = 1.0 if cfg.ramp == 0 else min(1.0, progress / cfg.ramp)
    cap = cfg.min_len * (cfg.seq_len / cfg.min_len) ** frac  # geometric ramp
    lens, t = [], cfg.min_len
    while t < cfg.seq_len and t <= cap:
        lens.append(t)
        t *= 2
    if cap >= cfg.seq_len or not lens:
        lens.append(cfg.seq_len if cap >= cfg.seq_len else cfg.min_len)
    return sorted(set(lens))


def pick_length(cfg: MixtureConfig, progress: float, rng: random.Random) -> int:
    """Half the batches at the current longest length, the rest uniform over the shorter ones."""
    lens = curriculum_lengths(cfg, progress)
    return lens[-1] if len(lens) == 1 or rng.random() < 0.5 else rng.choice(lens[:-1])


def encode_example(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt + answer and the positions whose next-token targets are answer tokens."""
    enc = tokenizer(prompt + answer, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    first = next((j for j, (s, e) in enumerate(enc["offset_mapping"]) if e > len(prompt)), len(ids))
    return ids, list(range(max(0, first - 1), len(ids) - 1))


KEYED_VALUE = re.compile(r"The special magic number for (\w+) is (\d+)\.")
BOUND_VALUE = re.compile(r"\b([a-z]) = (\d|[a-z])\b")


def extra_queries(pair, n: int, rng: random.Random) -> list[tuple[str, str]]:
    """Up to n more (query, answer) continuations for a multi-key NIAH or binding pair: other keys / variables
    of the same prompt asked in the prompt's own format, appended after the answer (several lookups per context,
    as in multi-query associative recall). Other families: []."""
    family = pair.meta.get("family", pair.task)
    asked: list[tuple[str, str]] = []
    if pair.task == "niah_multikey":
        values = dict(KEYED_VALUE.findall(pair.clean_prompt))
        others = [k for k in values if k != pair.meta.get("key")]
        for key in rng.sample(others, min(n, len(others))):
            asked.append((f"\nQuestion: What is the special magic number for {key}? Answer: The special magic number "
                          f"for {key} is", f" {values[key]}"))
    elif family == "binding":
        head = pair.clean_prompt.rsplit(". Then ", 1)[0]
        bound = dict(BOUND_VALUE.findall(head))
        value = {v: (bound[x] if not x.isdigit() else x) for v, x in bound.items() if x.isdigit() or x in bound}
        names = list(value)
        for name in (rng.choice(names) for _ in range(n if names else 0)):
            asked.append((f". Then {name} =", f" {value[name]}"))
    return asked


def encode_answers(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids of the concatenated pieces and the positions whose next-token targets lie in an answer piece
    (pieces: (text, is_answer))."""
    text, spans, at = "", [], 0
    for piece, is_answer in pieces:
        if is_answer:
            spans.append((at, at + len(piece)))
        text += piece
        at += len(piece)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    ans = [j - 1 for j, (s, e) in enumerate(enc["offset_mapping"])
           if j > 0 and any(s < b and e > a for a, b in spans)]
    return ids, ans


class MixtureStream:
    """Batches ``{"ids": [B, T] long, "w": [B, T] float, "kind": [B] long}`` keyed by step (see module doc)."""

    def __init__(self, cfg: MixtureConfig, tokenizer, text_ids: "torch.Tensor | TextSources", stage: str = "",
                 teacher_ids: torch.Tensor | None = None):
        self.cfg, self.tok = cfg, tokenizer
        # text rows: one corpus, or weighted sources (a source by weight, then a window inside it)
        self.sources = text_ids if isinstance(text_ids, TextSources) else None
        text_ids = text_ids.ids if isinstance(text_ids, TextSources) else text_ids
        self.text_ids = text_ids  # [N] the tokenized training corpus (all sources, concatenated)
        self.teacher_ids = teacher_ids  # [M] teacher-sampled text, or None
        self.stage = stage
        self.eos = tokenizer.eos_token_id
        self._tasks: dict = {}
        if cfg.weights()["teacher"] > 0 and (teacher_ids is None or len(teacher_ids) < cfg.seq_len + 2):
            raise ValueError(f"MixtureConfig.w_teacher={cfg.w_teacher} > 0 needs teacher_ids of more than seq_len="
                             f"{cfg.seq_len} tokens (sample_teacher); got "
                             f"{None if teacher_ids is None else len(teacher_ids)}")
        if len(text_ids) < cfg.seq_len + 2 and (cfg.weights()["text"] > 0 or cfg.weights()["copy"] > 0):
            raise ValueError(f"the corpus has {len(text_ids)} tokens, fewer than seq_len={cfg.seq_len} + 2: give a "
                             "longer corpus or a shorter seq_len")
        if self.sources is not None and cfg.weights()["text"] > 0:
            short = {n: k for n, k in self.sources.sizes().items() if k < cfg.seq_len + 2}
            if short:
                raise ValueError(f"text sources {short} have fewer tokens than seq_len={cfg.seq_len} + 2: give them "
                                 "weight 0 (leave them out of data.sources) or use a shorter seq_len")

    # ---- pickling (spawned data workers) ----------------------------------------------------
    def __getstate__(self) -> dict:
        """The tokenizer travels as a byte tensor: ForkingPickler (what starts a DataLoader's spawned workers)
        passes tensors through shared memory, so a worker's start-up message stays far below a pipe's 64 KiB.
        A pickled tokenizer (~100 KB) made each worker's start wait until the one before had imported everything
        and read it: the workers started one after another, ~20 s each, 4 minutes per stage on the H200."""
        if self.__dict__.get("_tok_bytes") is None:  # kept here: shared memory lives as long as its tensor
            self._tok_bytes = torch.frombuffer(bytearray(pickle.dumps(self.tok)), dtype=torch.uint8).clone()  # [S]
        state = self.__dict__.copy()
        state["tok"], state["_tasks"] = None, {}  # the tasks: a cache, rebuilt on first use
        state["_docs"] = None  # the document starts: rebuilt on first use
        return state

    def __setstate__(self, state: dict) -> None:
        state["tok"] = pickle.loads(state["_tok_bytes"].numpy().tobytes())
        self.__dict__.update(state)

    # ---- sources ---------------------------------------------------------------------------
    def _task(self, name: str, **cfg):
        from headscope.tasks import get_task

        key = (name, tuple(sorted(cfg.items())))
        if key not in self._tasks:
            self._tasks[key] = get_task(name, **cfg)
        return self._tasks[key]

    def _pair(self, task, rng: random.Random):
        from headscope.tasks.base import PairError

        for _ in range(50):
            try:
                return task.make_pair(self.tok, rng, rng.randrange(1 << 30), 1 << 30)
            except PairError:
                continue
        raise RuntimeError(f"{task!r}: no valid pair in 50 attempts")

    def text_row(self, T: int, rng: random.Random, source: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
        if source is None and self.cfg.text_windows == "documents":
            lo, hi = self.sources.span(self.sources.pick(rng)) if self.sources is not None else (0, len(self.text_ids))
            start = self.document_window(lo, hi, T, rng)
            return self.text_ids[start:start + T].tolist(), [1.0] * T
        if source is None and self.sources is not None:  # a source by weight, then a window inside it
            lo, hi = self.sources.span(self.sources.pick(rng))
            start = rng.randrange(lo, hi - T - 1)
            return self.text_ids[start:start + T].tolist(), [1.0] * T
        ids = self.text_ids if source is None else source  # [N]
        start = rng.randrange(0, len(ids) - T - 1)
        return ids[start:start + T].tolist(), [1.0] * T

    def document_starts(self) -> list[int]:
        """The positions in ``text_ids`` where a document starts, sorted: each source's start and every position
        after an end-of-text token (a source's documents each end with one, ``tokenize_documents``); a corpus
        without end-of-text tokens is one document. Made once per process (a few ms for tens of millions of ids)."""
        if self.__dict__.get("_docs") is None:
            ids = self.text_ids  # [N]
            after_eos = ((ids == self.eos).nonzero().flatten() + 1).tolist() if self.eos is not None else []  # [E]
            bounds = self.sources.bounds[:-1] if self.sources is not None else (0,)
            starts = set(after_eos) | set(bounds)
            self._docs = sorted(p for p in starts if p < len(ids))
        return self._docs

    def document_window(self, lo: int, hi: int, T: int, rng: random.Random) -> int:
        """The start of a ``T``-token window of the source ``text_ids[lo:hi]`` for long rows
        (``text_windows="documents"``): the document holding a token drawn uniformly from the source (so a document
        is drawn as often as its length: long documents most), then the window inside that document at a random
        offset when it has at least ``T`` tokens, else from the document's start on through the documents that
        follow it in the source (joined by their end-of-text tokens). Near the source's end the window starts at
        the last document start that leaves room for it. The window ``[start, start + T)`` stays inside ``[lo, hi)``
        (needs ``hi - lo >= T``)."""
        import bisect

        starts = self.document_starts()
        i = bisect.bisect_right(starts, rng.randrange(lo, hi)) - 1  # the drawn token's document
        s = starts[i]
        e = min(hi, starts[i + 1] if i + 1 < len(starts) else len(self.text_ids))  # [s, e): the document
        if e - s >= T:  # a long document: a window inside it
            return rng.randrange(s, e - T + 1)
        last = hi - T  # the latest start that keeps the window in the source
        if s <= last:
            return s
        return max(lo, starts[bisect.bisect_right(starts, last) - 1])

    def copy_row(self, T: int, rng: random.Random) -> tuple[list[int], list[float]]:
        n = rng.randint(16, min(128, max(16, T // 3)))
        if rng.random() < 0.5:  # a text snippet
            start = rng.randrange(0, len(self.text_ids) - n - 1)
            snippet = [self.eos] + self.text_ids[start:start + n].tolist()
        else:  # independent corpus tokens: nothing to predict but by copying
            snippet = [self.eos] + [int(self.text_ids[rng.randrange(len(self.text_ids))]) for _ in range(n)]
        ids = (snippet * (T // len(snippet) + 1))[:T]
        return ids, [1.0] * T

    def fast_niah_pair(self, ctx: int, rng: random.Random, multikey: bool, n_keys: int) -> SimpleNamespace:
        """A NIAH prompt in the task's format (its needle and question templates, needles at sentence
        boundaries) around a window of corpus tokens; about ctx tokens, not fitted exactly. Only the clean
        prompt and answer, with the fields ``extra_queries`` reads."""
        from headscope.tasks.haystack import insert_needles
        from headscope.tasks.niah import KEYED_NEEDLE, KEYED_QUESTION, KEYS, NEEDLE, QUESTION

        def value() -> str:
            return rng.choice("123456789") + "".join(rng.choice("0123456789") for _ in range(3))

        asked = value()
        while is_heldout_value(f" {asked}"):
            asked = value()
        if multikey:
            keys = rng.sample(KEYS, n_keys)
            needles = [(rng.random(), KEYED_NEEDLE.format(key=k, value=asked if i == 0 else value()))
                       for i, k in enumerate(keys)]
            question, key, task = KEYED_QUESTION.format(key=keys[0]), keys[0], "niah_multikey"
        else:
            needles = [(rng.random(), NEEDLE.format(value=asked))]
            question, key, task = QUESTION, None, "niah"
        extra = len(self.tok(" ".join(t for _, t in needles) + question + f" {asked}",
                             add_special_tokens=False)["input_ids"]) + 2  # needles, question, answer, joins
        n = max(16, ctx - extra)
        start = rng.randrange(0, len(self.text_ids) - n - 1)
        hay = self.tok.decode(self.text_ids[start:start + n].tolist())
        body, _ = insert_needles(hay.strip(), needles)
        return SimpleNamespace(task=task, meta={"family": "niah", "key": key}, clean_prompt=body + question,
                               clean_answer=f" {asked}")

    def niah_example(self, ctx: int, rng: random.Random, multikey: bool, n_keys: int = 2
                     ) -> tuple[list[int], list[float]]:
        """One NIAH prompt of ~ctx tokens + its answer: ids and loss weights (answer positions weighted)."""
        if self.cfg.fast_niah:
            ids, ans = self.encode_pair(self.fast_niah_pair(ctx, rng, multikey, n_keys), rng)
            return ids, self.loss_weights(len(ids), ans, self.cfg.haystack_weight)
        if multikey:
            task = self._task("niah_multikey", context_length=ctx, haystack=self.cfg.haystack, depth="random",
                              n_keys=n_keys)
        else:
            task = self._task("niah", context_length=ctx, depth="random", haystack=self.cfg.haystack)
        for _ in range(20):  # values reserved for evaluation never appear as the asked value in training
            pair = self._pair(task, rng)
            if not is_heldout_value(pair.clean_answer):
                break
        ids, ans = self.encode_pair(pair, rng)
        return ids, self.loss_weights(len(ids), ans, self.cfg.haystack_weight)

    def loss_weights(self, n: int, answer_positions: list[int], base: float) -> list[float]:
        """Per-token loss weights: ``base`` everywhere, ``cfg.answer_weight`` at the answer positions."""
        w = [base] * n
        for p in answer_positions:
            w[p] = self.cfg.answer_weight
        return w

    def encode_pair(self, pair, rng: random.Random) -> tuple[list[int], list[int]]:
        """ids of prompt + answer (+ extra queries and answers, cfg.extra_queries) and the answer positions."""
        extra = extra_queries(pair, rng.randint(0, self.cfg.extra_queries), rng) if self.cfg.extra_queries else []
        if not extra:
            return encode_example(self.tok, pair.clean_prompt, pair.clean_answer)
        pieces = [(pair.clean_prompt, False), (pair.clean_answer, True)]
        for query, answer in extra:
            pieces += [(query, False), (answer, True)]
        return encode_answers(self.tok, pieces)

    def _n_keys(self, T: int, rng: random.Random) -> int:
        return rng.randint(2, min(self.cfg.max_keys, max(2, T // 64)))  # short prompts hold few needles

    def niah_row(self, T: int, rng: random.Random, multikey: bool) -> tuple[list[int], list[float]]:
        if multikey and self.cfg.multikey_min_len and T >= 2 * self.cfg.multikey_min_len:
            return self.packed_multikey_row(T, rng)
        ctx = max(64, T - 8)  # context_length counts the whole prompt; the answer adds ~5 tokens
        ids, w = self.niah_example(ctx, rng, multikey, self._n_keys(T, rng) if multikey else 2)
        if len(ids) > T:  # should not happen (prompt <= ctx tokens); keep the answer, drop the start
            ids, w = ids[-T:], w[-T:]
        return ids, w

    def packed_multikey_row(self, T: int, rng: random.Random) -> tuple[list[int], list[float]]:
        """Multi-key prompts of random power-of-two lengths (multikey_min_len..T), separated by <|endoftext|>:
        many asked keys per row instead of one."""
        lo = self.cfg.multikey_min_len
        sizes = [n for n in (lo * 2 ** i for i in range(12)) if n <= T]
        ids: list[int] = []
        w: list[float] = []
        while T - len(ids) >= lo:
            room = T - len(ids)
            n = min(rng.choice(sizes), room)
            e_ids, e_w = self.niah_example(max(64, n - 9), rng, True, self._n_keys(n, rng))
            e_ids, e_w = e_ids[: room - 1], e_w[: room - 1]
            ids += e_ids + [self.eos]
            w += e_w + [self.cfg.haystack_weight]
        return ids, w

    def reasoning_task(self, rng: random.Random):
        """The task of the next reasoning example: the family mixture (stages 1-3), or with binding_vars other
        than (4, 4) a family drawn here and binding with n_vars ~ U[binding_vars]."""
        fams = tuple(self.cfg.reasoning_families)
        if self.cfg.binding_vars == (4, 4):
            return self._task("reasoning", families=fams)
        fam = rng.choice(fams)
        return self._task(fam, n_vars=rng.randint(*self.cfg.binding_vars)) if fam == "binding" else self._task(fam)

    def reasoning_row(self, T: int, rng: random.Random) -> tuple[list[int], list[float]]:
        ids, w = [], []
        while len(ids) < T:
            pair = self._pair(self.reasoning_task(rng), rng)
            e_ids, ans = self.encode_pair(pair, rng)
            ew = self.loss_weights(len(e_ids), ans, 1.0)
            ids += e_ids + [self.eos]
            w += ew + [1.0]
        return ids[:T], w[:T]

    # ---- batches ---------------------------------------------------------------------------
    def row(self, kind: str, T: int, rng: random.Random) -> tuple[list[int], list[float]]:
        if kind == "text":
            return self.text_row(T, rng)
        if kind == "teacher":
            return self.text_row(T, rng, self.teacher_ids)
        if kind == "reasoning":
            return self.reasoning_row(T, rng)
        if kind == "copy":
            return self.copy_row(T, rng)
        try:
            return self.niah_row(T, rng, multikey=(kind == "multikey"))
        except RuntimeError:  # no valid pair at this length: never stop training for it
            return self.text_row(T, rng)

    def batch(self, step: int, progress: float = 1.0, rows: range | None = None) -> dict[str, torch.Tensor]:
        """The rows ``rows`` (default all) of step ``step``'s batch, a pure function of (seed, stage, step)."""
        T = pick_length(self.cfg, progress, random.Random(f"{self.cfg.seed}:{self.stage}:{step}"))
        B = max(1, self.cfg.tokens_per_batch // T)
        rows = range(B) if rows is None else rows
        ws = self.cfg.weights()
        ids = torch.full((len(rows), T), self.eos, dtype=torch.long)  # [b, T]
        w = torch.zeros(len(rows), T)  # [b, T]
        kinds = []
        for b, r in enumerate(rows):
            rng = random.Random(f"{self.cfg.seed}:{self.stage}:{step}:{r}")
            kind = rng.choices(KINDS, weights=[ws[k] for k in KINDS])[0]
            row, rw = self.row(kind, T, rng)
            n = min(T, len(row))
            ids[b, :n] = torch.tensor(row[:n])
            w[b, :n] = torch.tensor(rw[:n])
            kinds.append(kind)
        w[:, -1] = 0.0  # the last position has no target
        kind_ids = torch.tensor([KINDS.index(k) for k in kinds], dtype=torch.long)  # [b]
        return {"ids": ids, "w": w, "kind": kind_ids, "step": torch.tensor(step)}

    def n_rows(self, step: int, progress: float = 1.0) -> int:
        T = pick_length(self.cfg, progress, random.Random(f"{self.cfg.seed}:{self.stage}:{step}"))
        return max(1, self.cfg.tokens_per_batch // T)


def rank_rows(n_rows: int, rank: int, world: int) -> range:
    """This process's contiguous share of a batch's rows (``n_rows`` must split evenly)."""
    if n_rows % world:
        raise ValueError(f"a batch of {n_rows} rows does not split over {world} processes: make batch_size "
                         f"(tokens per batch / seq_len) a multiple of the number of processes")
    per = n_rows // world
    return range(rank * per, (rank + 1) * per)


class StepBatches(IterableDataset):
    """Batches of steps ``start, start+1, ... < stop`` for this process (rank/world), built in DataLoader
    workers: worker i builds the steps ``start + i + k * n_workers``; the DataLoader takes workers in turn,
    so batches arrive in step order. The length curriculum's progress is step / total, or the value of
    ``progress`` (a ``multiprocessing.Value``) that the trainer sets when a stage runs on a time budget."""

    def __init__(self, stream: MixtureStream, start: int, stop: int, total: int, rank: int = 0, world: int = 1,
                 progress=None):
        self.stream, self.start, self.stop, self.total, self.rank, self.world = stream, start, stop, total, rank, world
        self.progress = progress

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for step in range(self.start + wid, self.stop, nw):
            p = step / max(1, self.total) if self.progress is None else float(self.progress.value)
            rows = rank_rows(self.stream.n_rows(step, p), self.rank, self.world)
            yield self.stream.batch(step, p, rows)


def describe_mixture(cfg: MixtureConfig) -> str:
    ws = cfg.weights()
    tot = sum(ws.values())
    parts = ", ".join(f"{k} {v / tot:.0%}" for k, v in ws.items() if v > 0)
    return f"{parts}; lengths {cfg.min_len}->{cfg.seq_len} over {cfg.ramp:.0%} of the run; " \
           f"{cfg.tokens_per_batch} tokens/batch; answer weight {cfg.answer_weight}"


def mixture_config(data, stage, seed: int) -> MixtureConfig:
    """The MixtureConfig of a stage (``hybrid.train.StageConfig``) with the run's mixture ``data``."""
    min_len = min(data.min_len, stage.seq_len) if data.min_len else stage.seq_len
    return MixtureConfig(
        seq_len=stage.seq_len, tokens_per_batch=stage.batch_size * stage.seq_len, w_text=data.text, w_niah=data.niah,
        w_multikey=data.multikey, w_reasoning=data.reasoning, w_copy=data.copy, w_teacher=data.teacher,
        answer_weight=data.answer_weight, min_len=min_len, ramp=data.ramp if data.min_len else 0.0,
        max_keys=data.max_keys, binding_vars=tuple(data.binding_vars), haystack_weight=data.haystack_weight,
        multikey_min_len=data.multikey_min_len, reasoning_families=tuple(data.reasoning_families),
        extra_queries=data.extra_queries, haystack=data.haystack, fast_niah=data.fast_niah,
        text_windows=getattr(data, "text_windows", "random"), seed=seed)


