"""Counterfactual prompt pairs: the data types, tokenization with validation, and the task registry.

A pair is a clean prompt and a corrupted prompt that differ only in one answer-bearing span, so that
every token position lines up. Both runs are teacher-forced with the CLEAN answer:

    clean_ids   = clean prompt tokens   + clean answer tokens[:-1]      # [T]
    corrupt_ids = corrupt prompt tokens + clean answer tokens[:-1]      # [T]
    answer_pos[i] = prompt_len - 1 + i: the logits there predict answer token i (clean or corrupt)

Answer tokens that the clean and corrupt answers share at their start (e.g. a lone "▁" that
SentencePiece tokenizers emit before digits) carry no signal, so they are moved into the prompt:
answer token 0 always differs between the two answers.
"""
from __future__ import annotations

import difflib
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from headscope.configs import from_dict
from headscope.registry import Registry
from headscope.tokenizers import bos_id  # noqa: F401  (re-exported: tasks import it from here)

Span = tuple[int, int]


class PairError(ValueError):
    """A prompt pair that cannot be used: positions would not line up, or the answers do not differ.

    fatal=True tells Task.generate() not to retry (the problem does not depend on the random draw).
    """

    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


class UnknownTaskError(LookupError):
    """get_task() was given a name that is not registered."""


@dataclass(frozen=True)
class PromptPair:
    clean_prompt: str
    corrupt_prompt: str
    clean_answer: str  # usually starts with a space: " 4321"
    corrupt_answer: str
    changed_spans: tuple[Span, ...]  # (start_char, end_char) in clean_prompt that the corruption changes
    task: str = "custom"
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def short(self, width: int = 60) -> str:
        """A one-line repr for error messages: the changed region of both prompts and the answers."""
        s, e = (self.changed_spans[0][0], self.changed_spans[-1][1]) if self.changed_spans else (0, 0)
        lo = max(0, s - width // 2)
        tail = len(self.clean_prompt) - e
        clean = self.clean_prompt[lo: e + width // 2]
        corrupt = self.corrupt_prompt[lo: len(self.corrupt_prompt) - tail + width // 2]
        dots = "..." if lo > 0 else ""
        return (f"clean={dots}{clean!r}... -> {self.clean_answer!r}, "
                f"corrupt={dots}{corrupt!r}... -> {self.corrupt_answer!r}")


@dataclass(frozen=True)
class TokenizedPair:
    clean_ids: torch.Tensor  # [T] prompt + clean answer[:-1]
    corrupt_ids: torch.Tensor  # [T] corrupt prompt + clean answer[:-1]
    answer_pos: torch.Tensor  # [A] positions whose next-token logits predict answer token i
    clean_answer_ids: torch.Tensor  # [A]
    corrupt_answer_ids: torch.Tensor  # [A]
    first_diff: int  # first position where clean_ids != corrupt_ids
    diff_pos: torch.Tensor  # [P] every position where clean_ids != corrupt_ids
    pair: PromptPair
    prompt_len: int = 0  # tokens before the first answer token (answer_pos[0] == prompt_len - 1)

    @property
    def seq_len(self) -> int:
        return self.clean_ids.shape[0]


# ----------------------------------------------------------------------------- tokenization helpers


def encode(tokenizer, text: str, offsets: bool = False) -> tuple[list[int], list[Span] | None]:
    """Token ids of text as the model sees it (BOS only if the tokenizer normally adds one).

    With offsets=True and a fast tokenizer, also the (start, end) characters of each token; BOS is (0, 0).
    """
    fast = offsets and getattr(tokenizer, "is_fast", False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast)
    ids = list(enc.input_ids)
    offs = [tuple(o) for o in enc["offset_mapping"]] if fast else None
    bos = bos_id(tokenizer)
    if bos is not None:
        ids = [bos] + ids
        offs = [(0, 0)] + offs if offs is not None else None
    return ids, offs


def n_tokens(tokenizer, text: str) -> int:
    """Number of tokens in text without special tokens (for matching value lengths in generators)."""
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _allowed_positions(tokenizer, pair: PromptPair, ids: list[int], offs: list[Span] | None) -> set[int]:
    """Prompt token positions that may differ: those overlapping a changed span."""
    if offs is not None:
        return {j for j, (a, b) in enumerate(offs) if any(a < e and b > s for s, e in pair.changed_spans)}
    # Slow tokenizer: everything between the tokens of the unchanged prefix and unchanged suffix (+1 each side).
    first, last = min(s for s, _ in pair.changed_spans), max(e for _, e in pair.changed_spans)
    n_pre = len(encode(tokenizer, pair.clean_prompt[:first])[0])
    n_post = n_tokens(tokenizer, pair.clean_prompt[last:])
    return set(range(max(0, n_pre - 1), min(len(ids), len(ids) - n_post + 1)))


def _check_text(pair: PromptPair, task: str) -> None:
    """The prompts must agree outside the changed spans."""
    if not pair.changed_spans:
        raise PairError(f"[{task}] pair has no changed_spans: {pair.short()}. "
                        "Fix: pass the (start, end) characters of the clean prompt that the corruption changes.")
    spans = sorted(pair.changed_spans)
    for s, e in spans:
        if not (0 <= s <= e <= len(pair.clean_prompt)):
            raise PairError(f"[{task}] changed span {(s, e)} is outside the clean prompt "
                            f"(length {len(pair.clean_prompt)}): {pair.short()}. Fix: give character offsets "
                            "into the clean prompt.")
    first, last = spans[0][0], spans[-1][1]
    tail = len(pair.clean_prompt) - last
    if pair.clean_prompt[:first] != pair.corrupt_prompt[:first] or \
            pair.clean_prompt[last:] != pair.corrupt_prompt[len(pair.corrupt_prompt) - tail:]:
        raise PairError(f"[{task}] the prompts differ outside changed_spans {spans}: {pair.short()}. "
                        "Fix: widen changed_spans to cover every character the corruption changes.")


def tokenize_pair(tokenizer, pair: PromptPair) -> TokenizedPair:
    """Tokenize a pair for teacher-forced clean/corrupt runs and validate that positions line up.

    Raises PairError naming the task, the pair, what is wrong and how to fix it.
    """
    task = pair.task
    _check_text(pair, task)
    if pair.clean_answer == pair.corrupt_answer:
        raise PairError(f"[{task}] clean and corrupt answers are both {pair.clean_answer!r}: {pair.short()}. "
                        "Fix: the corruption must change the answer.")
    p_clean, offs = encode(tokenizer, pair.clean_prompt, offsets=True)
    p_corrupt, _ = encode(tokenizer, pair.corrupt_prompt)
    answers = []
    for prompt, p_ids, answer in ((pair.clean_prompt, p_clean, pair.clean_answer),
                                  (pair.corrupt_prompt, p_corrupt, pair.corrupt_answer)):
        full, _ = encode(tokenizer, prompt + answer)
        if full[: len(p_ids)] != p_ids:
            raise PairError(f"[{task}] the prompt's tokens are not a prefix of prompt+answer {answer!r}: the answer "
                            f"merges with the prompt's last token ({pair.short()}). Fix: start the answer with a "
                            "space or end the prompt at a word boundary.")
        answers.append(full[len(p_ids):])
    a_clean, a_corrupt = answers
    if len(p_clean) != len(p_corrupt):
        raise PairError(f"[{task}] prompts tokenize to {len(p_clean)} and {len(p_corrupt)} tokens: {pair.short()}. "
                        "Fix: choose corrupted values with the same token count as the clean ones.")
    if len(a_clean) != len(a_corrupt):
        raise PairError(f"[{task}] answers {pair.clean_answer!r} and {pair.corrupt_answer!r} tokenize to "
                        f"{len(a_clean)} and {len(a_corrupt)} tokens: {pair.short()}. "
                        "Fix: choose values with equal token counts.")
    if not a_clean:
        raise PairError(f"[{task}] the answer {pair.clean_answer!r} has no tokens: {pair.short()}. "
                        "Fix: give a non-empty answer.")
    if a_clean == a_corrupt:
        raise PairError(f"[{task}] answers {pair.clean_answer!r} and {pair.corrupt_answer!r} tokenize identically: "
                        f"{pair.short()}. Fix: choose answers that differ as tokens.")
    diff = [j for j, (a, b) in enumerate(zip(p_clean, p_corrupt)) if a != b]
    if not diff:
        raise PairError(f"[{task}] clean and corrupt prompts tokenize identically: {pair.short()}. "
                        "Fix: the corruption must change the prompt.")
    allowed = _allowed_positions(tokenizer, pair, p_clean, offs)
    stray = [j for j in diff if j not in allowed]
    if stray:
        raise PairError(f"[{task}] prompts differ at token positions {stray[:5]} outside changed_spans "
                        f"{list(pair.changed_spans)}: {pair.short()}. Fix: make the corruption change only the span, "
                        "with values that tokenize the same way around it.")

    # Shared leading answer tokens (e.g. a lone "▁") move into the prompt: answer token 0 must differ.
    k = 0
    while a_clean[k] == a_corrupt[k]:
        k += 1
    prompt_clean, prompt_corrupt = p_clean + a_clean[:k], p_corrupt + a_clean[:k]
    a_clean, a_corrupt = a_clean[k:], a_corrupt[k:]
    n_prompt = len(prompt_clean)
    clean_ids = torch.tensor(prompt_clean + a_clean[:-1], dtype=torch.long)  # [T]
    corrupt_ids = torch.tensor(prompt_corrupt + a_clean[:-1], dtype=torch.long)  # [T]
    diff_pos = (clean_ids != corrupt_ids).nonzero().flatten()  # [P]
    return TokenizedPair(
        clean_ids=clean_ids,
        corrupt_ids=corrupt_ids,
        answer_pos=torch.arange(len(a_clean), dtype=torch.long) + n_prompt - 1,  # [A]
        clean_answer_ids=torch.tensor(a_clean, dtype=torch.long),  # [A]
        corrupt_answer_ids=torch.tensor(a_corrupt, dtype=torch.long),  # [A]
        first_diff=int(diff_pos[0]),
        diff_pos=diff_pos,
        pair=pair,
        prompt_len=n_prompt,
    )


# ----------------------------------------------------------------------------- tasks

def make_config(cls, task: str, config: dict):
    """Build a frozen config dataclass from kwargs; unknown fields are a ValueError naming them."""
    return from_dict(cls, config, where=f"task {task!r}", unknown_text="no config field(s)")


class Task:
    """A generator of counterfactual pairs. Subclasses set `name`, `Config` and implement make_pair()."""

    name: str = "task"
    Config: type = None
    max_tries: int = 200  # attempts per sample to find a pair that passes tokenize_pair

    def __init__(self, **config):
        if self.Config is None and config:
            raise ValueError(f"task {self.name!r} takes no config; got {sorted(config)}")
        self.config = make_config(self.Config, self.name, config) if self.Config is not None else None

    #: how many distinct pairs the task holds (None: it generates as many as asked). A task with a fixed pool
    #: (``from_pairs``) sets it; ``n_samples=None`` / ``n=None`` then means all of them.
    n_available: int | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    def make_pair(self, tokenizer, rng: random.Random, index: int, n: int) -> PromptPair:
        """One candidate pair for sample `index` of `n`; may raise PairError (generate() retries)."""
        raise NotImplementedError

    def _generate(self, tokenizer, n: int, seed: int) -> list[tuple[PromptPair, TokenizedPair]]:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r}: ask for at least one pair (n >= 1)")
        return [self.sample(tokenizer, i, n, seed) for i in range(n)]

    def sample(self, tokenizer, i: int, n: int, seed: int) -> tuple[PromptPair, TokenizedPair]:
        """Sample ``i`` of ``n`` (what ``generate(tokenizer, n, seed)[i]`` holds), built on its own."""
        rng = random.Random(f"{self.name}:{seed}:{i}")  # sample i is the same whatever n is
        err = None
        for _ in range(self.max_tries):
            try:
                pair = self.make_pair(tokenizer, rng, i, n)
                return pair, tokenize_pair(tokenizer, pair)
            except PairError as e:
                if e.fatal:
                    raise
                err = e
        raise PairError(f"[{self.name}] no valid pair for sample {i} after {self.max_tries} attempts with "
                        f"this tokenizer; last problem: {err}")

    def generate(self, tokenizer, n: int = 16, seed: int = 0) -> list[PromptPair]:
        """n validated pairs, deterministic for (task config, tokenizer, seed)."""
        return [p for p, _ in self._generate(tokenizer, n, seed)]

    def tokenized(self, tokenizer, n: int = 16, seed: int = 0) -> list[TokenizedPair]:
        """generate() + tokenize_pair() for each pair."""
        return [t for _, t in self._generate(tokenizer, n, seed)]


def infer_spans(clean: str, corrupt: str) -> tuple[Span, ...]:
    """The (start, end) characters of clean that differ from corrupt: one span from first to last change."""
    blocks = difflib.SequenceMatcher(None, clean, corrupt, autojunk=False).get_opcodes()
    changed = [(i1, i2) for op, i1, i2, _, _ in blocks if op != "equal"]
    if not changed:
        return ()
    # One span from first to last change keeps the "prompts agree outside the spans" check simple.
    return ((changed[0][0], changed[-1][1]),)


class CustomTask(Task):
    """A task built from the user's own (clean, corrupt, clean_answer, corrupt_answer) tuples."""

    def __init__(self, name: str, pairs: list[PromptPair]):
        super().__init__()
        self.name, self.pairs = name, pairs

    def __repr__(self) -> str:
        return f"CustomTask({self.name!r}, {len(self.pairs)} pairs)"

    @property
    def n_available(self) -> int:
        return len(self.pairs)

    def _generate(self, tokenizer, n: int | None, seed: int):
        """``n=None``: all pairs (in the user's order); an int picks a seeded subset of that many."""
        if n is None:
            n = len(self.pairs)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(self.pairs):
            raise ValueError(f"n={n!r}: task {self.name!r} holds {len(self.pairs)} {_pairs_word(len(self.pairs))}; pass n=None for all "
                             f"{len(self.pairs)} (n_samples=None in headscope.score / sender_scores / knockout_curve "
                             f"/ knockout_eval) or a count 1 <= n <= {len(self.pairs)}")
        order = list(range(len(self.pairs)))
        random.Random(f"{self.name}:{seed}").shuffle(order)
        picked = [self.pairs[i] for i in sorted(order[:n])]  # a seeded subset, kept in the user's order
        return [(p, tokenize_pair(tokenizer, p)) for p in picked]

    def generate(self, tokenizer, n: int | None = None, seed: int = 0) -> list[PromptPair]:
        return [p for p, _ in self._generate(tokenizer, n, seed)]

    def tokenized(self, tokenizer, n: int | None = None, seed: int = 0) -> list[TokenizedPair]:
        return [t for _, t in self._generate(tokenizer, n, seed)]


def from_pairs(name: str, pairs) -> CustomTask:
    """A task from [(clean, corrupt, clean_answer, corrupt_answer), ...]; the changed span is inferred by diff."""
    built = []
    for i, item in enumerate(pairs):
        if isinstance(item, PromptPair):
            built.append(item)
            continue
        if len(item) != 4 or not all(isinstance(x, str) for x in item):
            raise ValueError(f"pair {i} of {name!r} is {item!r}; give (clean, corrupt, clean_answer, corrupt_answer) "
                             "strings")
        clean, corrupt, a_clean, a_corrupt = item
        spans = infer_spans(clean, corrupt)
        if not spans:
            raise PairError(f"[{name}] pair {i}: clean and corrupt prompts are identical ({clean[-60:]!r}). "
                            "Fix: the corrupt prompt must change the answer-bearing span.")
        built.append(PromptPair(clean, corrupt, a_clean, a_corrupt, spans, task=name, meta={"index": i}))
    if not built:
        raise ValueError(f"from_pairs({name!r}, ...) got no pairs; give at least one")
    return CustomTask(name, built)


def _pairs_word(n: int) -> str:
    return "pair" if n == 1 else "pairs"


def resolve_n_samples(task: Any, n_samples: Any, *, model: Any = None, task_options: dict | None = None,
                      who: str = "score") -> int:
    """The pair count a scorer asks ``task`` for: the one rule of ``n_samples`` everywhere
    (``headscope.score``, ``sender_scores``, ``iterated_path_patching``, ``knockout_curve``, ``knockout_eval``).

    ``n_samples=None`` means all pairs: every pair of a task with a fixed pool (``from_pairs``; its
    ``n_available``) or of a list of TokenizedPair; a generated task (``"niah"``, ...) has no "all" and
    needs a count. An int must be >= 1 and, for a fixed pool, at most the pairs it holds: a larger count
    is refused saying how many there are and suggesting ``n_samples=None``. A list of TokenizedPair is
    used whole whatever the count (as ``headscope.pairs.task_pairs`` does). ``task`` given by name is
    built (with ``model``'s registry task defaults and ``task_options``) to find its pool.
    """
    if isinstance(task, (list, tuple)):
        if n_samples is not None and (isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1):
            raise ValueError(f"{who}: n_samples must be an int >= 1, or None for all pairs, got {n_samples!r}")
        return len(task) if n_samples is None else n_samples
    if n_samples is not None and (isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1):
        raise ValueError(f"{who}: n_samples must be an int >= 1, or None for all pairs of a task built from a "
                         f"fixed list (from_pairs), got {n_samples!r}")
    built = task
    if isinstance(task, str):
        from headscope.zoo import task_defaults
        from headscope.tokenizers import unwrap

        defaults = task_defaults(unwrap(model), task) if model is not None else {}
        built = get_task(task, **{**defaults, **(task_options or {})})
    pool = getattr(built, "n_available", None)
    name = getattr(built, "name", task)
    if n_samples is None:
        if pool is None:
            raise ValueError(f"{who}: n_samples=None means all pairs, but task {name!r} generates pairs (it has no "
                             "fixed set); give a count, e.g. n_samples=8")
        return int(pool)
    if pool is not None and n_samples > pool:
        raise ValueError(f"{who}: n_samples={n_samples} but task {name!r} holds {pool} {_pairs_word(pool)}; pass "
                         f"n_samples=None to use all {pool}, or a count 1..{pool}")
    return n_samples


# ----------------------------------------------------------------------------- registry

TASKS: Registry[Callable[..., Task]] = Registry("task", owner="headscope.tasks.TASKS")


def register_task(name: str, factory: Callable[..., Task], *, overwrite: bool = False) -> None:
    """Make get_task(name, **config) call factory(**config). A taken name (a built-in task included) needs
    ``overwrite=True``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"task name {name!r}: give a non-empty string")
    if not callable(factory):
        raise ValueError(f"factory for task {name!r} is {factory!r}; give a callable returning a Task")
    TASKS.register(name, factory, overwrite=overwrite)


def list_tasks() -> list[str]:
    return sorted(TASKS)


def get_task(name: str, **config) -> Task:
    """The registered task `name`, configured by keyword arguments (its config dataclass fields)."""
    if name not in TASKS:
        raise UnknownTaskError(f"unknown task {name!r}; known tasks: {', '.join(list_tasks())}. "
                               "Register your own with register_task(name, factory) or from_pairs(name, pairs).")
    return TASKS[name](**config)
