"""Needle-in-a-haystack pairs: "niah" (one unkeyed needle) and "niah_multikey" (several keyed needles).

Prompt (context_length tokens in all, measured with the given tokenizer):

    <haystack text ... The special magic number is 4321. ... haystack text>
    Question: What is the special magic number? Answer: The special magic number is      -> " 4321"

The corrupted prompt swaps the needle's value (4321 -> 8765); the two values have the same token count
and different first digits, so the first answer token differs. niah_multikey inserts n_keys needles
"The special magic number for <key> is <value>." and asks for one key; only that key's value changes.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

from headscope.tasks.base import PairError, PromptPair, Task, bos_id, encode, n_tokens
from headscope.tasks.haystack import chunk, insert_needles, load_haystack, paragraph_starts

KEYS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "garden", "silver", "window",
        "rabbit", "candle", "forest", "orange", "bridge", "Anna", "David", "Maria", "Peter", "Laura")
NEEDLE = "The special magic number is {value}."
QUESTION = "\nQuestion: What is the special magic number? Answer: The special magic number is"
KEYED_NEEDLE = "The special magic number for {key} is {value}."
KEYED_QUESTION = "\nQuestion: What is the special magic number for {key}? Answer: The special magic number for {key} is"
FIXED_VALUES = ("43210987" * 2, "87654321" * 2)  # random_values=False: 4321 -> 8765 (cut to value_digits)


@dataclass(frozen=True)
class NiahConfig:
    context_length: int = 1024  # tokens of the whole prompt (haystack + needles + question)
    depth: float | str = 0.5  # needle position as a fraction of the haystack, "uniform" over samples, or "random"
    haystack: str = "heldout"  # "heldout", "train", a text file path, or the text itself
    n_needles: int = 1  # 1 = just the asked needle; more adds keyed distractor needles at random depths
    random_values: bool = True  # False: always 4321 -> 8765
    value_digits: int = 4
    tolerance: float = 0.02  # the prompt has between (1 - tolerance) * context_length and context_length tokens

    def __post_init__(self):
        if not isinstance(self.context_length, int) or self.context_length < 32:
            raise ValueError(f"context_length={self.context_length!r}: give an int >= 32 (tokens)")
        if isinstance(self.depth, str):
            if self.depth not in ("uniform", "random"):
                raise ValueError(f"depth={self.depth!r}: give a float in [0, 1], 'uniform' or 'random'")
        elif not isinstance(self.depth, (int, float)) or not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"depth={self.depth!r}: give a float in [0, 1], 'uniform' or 'random'")
        if not isinstance(self.n_needles, int) or not 1 <= self.n_needles <= len(KEYS) + 1:
            raise ValueError(f"n_needles={self.n_needles!r}: give an int in [1, {len(KEYS) + 1}]")
        if not isinstance(self.value_digits, int) or not 1 <= self.value_digits <= 9:
            raise ValueError(f"value_digits={self.value_digits!r}: give an int in [1, 9]")
        if not isinstance(self.haystack, str) or not self.haystack:
            raise ValueError(f"haystack={self.haystack!r}: give 'heldout', 'train', a file path or text")
        if not 0.0 <= self.tolerance <= 0.5:
            raise ValueError(f"tolerance={self.tolerance!r}: give a fraction in [0, 0.5]")


@dataclass(frozen=True)
class NiahMultikeyConfig(NiahConfig):
    n_keys: int = 4  # keyed needles in the haystack; one of them is asked

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.n_keys, int) or not 1 <= self.n_keys <= len(KEYS):
            raise ValueError(f"n_keys={self.n_keys!r}: give an int in [1, {len(KEYS)}]")


class NiahTask(Task):
    name = "niah"
    Config = NiahConfig
    max_tries = 20

    def __init__(self, **config):
        super().__init__(**config)
        self.text = load_haystack(self.config.haystack)
        if len(self.text) < 200:
            raise ValueError(f"haystack has only {len(self.text)} characters; give at least a few paragraphs of text")

    # ---- pieces of the prompt

    def _needles(self, rng: random.Random) -> tuple[list[str], list[str], str]:
        """(keys, needle templates with a {value} slot, question); keys[0]/needles[0] is the asked needle."""
        c = self.config
        keys = rng.sample(KEYS, c.n_needles - 1)
        return [None] + keys, [NEEDLE] + [KEYED_NEEDLE.replace("{key}", k) for k in keys], QUESTION

    def _depth(self, rng: random.Random, index: int, n: int) -> float:
        d = self.config.depth
        if d == "uniform":
            return index / (n - 1) if n > 1 else 0.5
        if d == "random":
            return rng.random()
        return float(d)

    def _random_value(self, rng: random.Random, first_digit_not: str | None = None) -> str:
        k = self.config.value_digits
        first = rng.choice([d for d in "123456789" if d != first_digit_not])
        return first + "".join(rng.choice("0123456789") for _ in range(k - 1))

    def _values(self, tokenizer, rng: random.Random, needle: str, answer_prefix: str) -> tuple[str, str]:
        """Clean and corrupt values with different first digits and equal token counts in needle and answer."""
        k = self.config.value_digits
        for _ in range(200):
            if self.config.random_values:
                a = self._random_value(rng)
                b = self._random_value(rng, first_digit_not=a[0])
            else:
                a, b = FIXED_VALUES[0][:k], FIXED_VALUES[1][:k]
            same = (n_tokens(tokenizer, needle.format(value=a)) == n_tokens(tokenizer, needle.format(value=b))
                    and n_tokens(tokenizer, f"{answer_prefix} {a}") == n_tokens(tokenizer, f"{answer_prefix} {b}"))
            if same:
                return a, b
            if not self.config.random_values:
                raise PairError(f"[{self.name}] fixed values {a} and {b} tokenize to different token counts with this "
                                "tokenizer. Fix: use random_values=True (values are then matched per tokenizer).",
                                fatal=True)
        raise PairError(f"[{self.name}] found no {k}-digit values with equal token counts. "
                        "Fix: try another value_digits.", fatal=True)

    # ---- fitting the haystack to context_length

    def _build(self, hay: str, needles: list[tuple[float, str]], question: str) -> tuple[str, list[int]]:
        body, starts = insert_needles(hay.rstrip(), needles)
        return body.rstrip() + question, starts

    def _measure(self, tokenizer, hay: str, needles, question: str) -> tuple[str, list[int], int, int]:
        """(prompt, needle offsets, prompt tokens, haystack chars) for this haystack prefix."""
        prompt, pos = self._build(hay, needles, question)
        return prompt, pos, len(encode(tokenizer, prompt)[0]), len(hay)

    def _bracket(self, tokenizer, hay: str, offs: list | None, cuts: list[int], needles, question: str, budget: int):
        """A cut-index range [lo, hi] holding the best cut, and the fitting prompt just below lo (or None).

        With a fast tokenizer the haystack's token offsets `offs` give the cut for `budget` haystack tokens
        directly; a small window around it is checked so the binary search takes a few steps, not ~16.
        """
        L = self.config.context_length
        if offs is not None and 0 < budget < len(offs):
            i = max(0, bisect.bisect_right(cuts, offs[budget - 1][1]) - 1)
            for w in (16, 256):
                a, b = max(0, i - w), min(len(cuts) - 1, i + w)
                fa = self._measure(tokenizer, hay[: cuts[a]], needles, question)
                if fa[2] <= L and self._measure(tokenizer, hay[: cuts[b]], needles, question)[2] > L:
                    return a + 1, b - 1, fa
        return 0, len(cuts) - 1, None

    def _fit(self, tokenizer, rng: random.Random, needles: list[tuple[float, str]], question: str):
        """Largest haystack (cut at a word boundary) whose prompt fits context_length tokens."""
        L, tol = self.config.context_length, self.config.tolerance
        overhead = len(encode(tokenizer, self._build("", needles, question)[0])[0])
        if overhead + 8 > L:
            raise PairError(f"[{self.name}] needles and question alone take {overhead} tokens, leaving no room for a "
                            f"haystack in context_length={L}. Fix: raise context_length or lower n_needles/n_keys.",
                            fatal=True)
        starts = paragraph_starts(self.text)
        start = starts[rng.randrange(len(starts))]
        n_chars = 6 * L + 2000
        while True:  # a haystack chunk with more tokens than the budget (wrapping around if needed)
            hay = chunk(self.text, start, n_chars)
            ids, offs = encode(tokenizer, hay, offsets=True)
            if len(ids) + overhead > L + 16 or n_chars > 64 * L:
                break
            n_chars *= 2
        cuts = [i for i, ch in enumerate(hay) if ch.isspace()] + [len(hay)]
        if offs is not None and bos_id(tokenizer) is not None:
            offs = offs[1:]
        lo, hi, best = self._bracket(tokenizer, hay, offs, cuts, needles, question, L - overhead)
        while lo <= hi:  # largest cut in [lo, hi] that fits; best holds the largest fitting one so far
            mid = (lo + hi) // 2
            found = self._measure(tokenizer, hay[: cuts[mid]], needles, question)
            if found[2] <= L:
                best, lo = found, mid + 1
            else:
                hi = mid - 1
        if best is None or best[2] < (1 - tol) * L:
            got = best[2] if best else overhead
            raise PairError(f"[{self.name}] could only fit {got} of context_length={L} tokens at a word boundary. "
                            "Fix: raise tolerance or give a haystack with shorter words.")
        return best

    # ---- one pair

    def make_pair(self, tokenizer, rng: random.Random, index: int, n: int) -> PromptPair:
        c = self.config
        keys, templates, question = self._needles(rng)
        depth = self._depth(rng, index, n)
        answer_prefix = question.rsplit("Answer: ", 1)[1]
        clean_v, corrupt_v = self._values(tokenizer, rng, templates[0], answer_prefix)
        others = [self._random_value(rng) for _ in templates[1:]]
        needles = [(depth, templates[0].format(value=clean_v))]
        needles += [(rng.random(), t.format(value=v)) for t, v in zip(templates[1:], others)]
        prompt, starts, n_tok, _ = self._fit(tokenizer, rng, needles, question)
        body_chars = len(prompt) - len(question)  # haystack with needles, before the question
        s = starts[0] + templates[0].index("{value}")
        e = s + len(clean_v)
        assert prompt[s:e] == clean_v
        corrupt = prompt[:s] + corrupt_v + prompt[e:]
        meta = dict(family="niah", depth=depth, needle_depth=starts[0] / max(1, body_chars),
                    context_length=c.context_length, prompt_tokens=n_tok, key=keys[0], value=clean_v,
                    corrupt_value=corrupt_v, n_needles=len(needles), haystack=c.haystack if len(c.haystack) < 200
                    else "<text>", distractor_keys=keys[1:])
        return PromptPair(prompt, corrupt, f" {clean_v}", f" {corrupt_v}", ((s, e),), task=self.name, meta=meta)


class NiahMultikeyTask(NiahTask):
    name = "niah_multikey"
    Config = NiahMultikeyConfig

    def _needles(self, rng: random.Random):
        keys = rng.sample(KEYS, self.config.n_keys)
        templates = [KEYED_NEEDLE.replace("{key}", k) for k in keys]
        return keys, templates, KEYED_QUESTION.format(key=keys[0])


HELDOUT_MODULUS = 7  # the reference model never saw NIAH values divisible by 7 asked in training


def is_heldout_value(answer: str) -> bool:
    """True for NIAH answers (" 4321") reserved for evaluation: the value is a multiple of HELDOUT_MODULUS."""
    digits = answer.strip()
    return digits.isdigit() and int(digits) % HELDOUT_MODULUS == 0
