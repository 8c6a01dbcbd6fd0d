"""Reasoning pairs: one changed fact flips the answer. Short prompts (~20-60 tokens) in fixed formats.

    arithmetic  "Compute: 2 + 4 = 6\nCompute: 7 - 3 = 4\nCompute: 3 + 5 ="              -> " 8"   (an operand changes)
    binding     "Let a = 4, b = 7, c = 2, d = 9, e = b. Then e ="                       -> " 7"   (b's value changes)
    comparison  "Alice is 34 years old. Bob is 29 years old. Who is older? Answer:"    -> " Alice" (her age drops)
    two_hop     "Alice lives in Paris. Bob lives in Rome. Paris is in France. Rome is in Italy.
                 Which country does Alice live in? Answer:"                             -> " France" (her city changes)
    reasoning   an even mixture of the four (meta["family"] names the family)

Clean and corrupt answers always differ in their first character (digits, names and countries with
distinct first letters), hence in their first answer token.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from headscope.registry import Registry
from headscope.tasks.base import PairError, PromptPair, Task

NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack", "Kate", "Liam",
         "Mary", "Noah", "Olga", "Paul", "Rose", "Sam", "Tom", "Vera", "Will")  # distinct first letters
PLACES = (("Paris", "France"), ("Rome", "Italy"), ("Berlin", "Germany"), ("Madrid", "Spain"), ("Tokyo", "Japan"),
          ("Cairo", "Egypt"), ("Lima", "Peru"), ("Oslo", "Norway"), ("Ottawa", "Canada"), ("Nairobi", "Kenya"),
          ("Moscow", "Russia"), ("Vienna", "Austria"), ("Ankara", "Turkey"), ("Hanoi", "Vietnam"),
          ("Budapest", "Hungary"), ("Beirut", "Lebanon"), ("Muscat", "Oman"), ("Rio", "Brazil"),
          ("Copenhagen", "Denmark"), ("Dublin", "Ireland"))  # countries have distinct first letters
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name}={value!r}: give an int in [{lo}, {hi}]")


def _pair(task: str, clean: str, start: int, old: str, new: str, answer: str, corrupt_answer: str,
          **meta) -> PromptPair:
    """A pair whose corrupt prompt replaces clean[start:start+len(old)] (== old) by new."""
    assert clean[start: start + len(old)] == old, (clean, start, old)
    corrupt = clean[:start] + new + clean[start + len(old):]
    return PromptPair(clean, corrupt, answer, corrupt_answer, ((start, start + len(old)),), task=task, meta=meta)


SHOT_SEP = "\n"  # between solved examples and before the query


class _FewShot:
    """Prepends ``config.n_shots`` solved examples of the same family (drawn from the same rng) to the query.

    The examples are identical in the clean and corrupt prompts, so the changed span only moves right and the
    token alignment is untouched. Subclasses implement ``_query(tokenizer, rng)`` -> PromptPair.
    """

    def _draw(self, tokenizer, rng) -> PromptPair:
        """One query, redrawn (same rng) while the draw itself is unusable."""
        for _ in range(self.max_tries - 1):
            try:
                return self._query(tokenizer, rng)
            except PairError as err:
                if err.fatal:
                    raise
        return self._query(tokenizer, rng)

    def make_pair(self, tokenizer, rng, index, n):
        shots = []
        for _ in range(self.config.n_shots):
            solved = self._draw(tokenizer, rng)
            shots.append(solved.clean_prompt + solved.clean_answer + SHOT_SEP)
        pair = self._draw(tokenizer, rng)
        prefix = "".join(shots)
        if not prefix:
            return pair
        return dataclasses.replace(
            pair, clean_prompt=prefix + pair.clean_prompt, corrupt_prompt=prefix + pair.corrupt_prompt,
            changed_spans=tuple((s + len(prefix), e + len(prefix)) for s, e in pair.changed_spans),
            meta={**pair.meta, "n_shots": self.config.n_shots})


# ----------------------------------------------------------------------------- arithmetic

@dataclass(frozen=True)
class ArithmeticConfig:
    ops: str = "+-"  # operators to sample from
    n_shots: int = 2  # solved examples before the query
    max_value: int = 9  # operands and results in [0, max_value]; 9 keeps everything single-digit

    def __post_init__(self):
        if not self.ops or any(o not in "+-" for o in self.ops):
            raise ValueError(f"ops={self.ops!r}: give a non-empty string of '+' and '-'")
        _check_int("n_shots", self.n_shots, 0, 10)
        _check_int("max_value", self.max_value, 2, 9)


class ArithmeticTask(Task):
    name = "arithmetic"
    Config = ArithmeticConfig

    def _problem(self, rng: random.Random) -> tuple[int, str, int, int]:
        m, op = self.config.max_value, rng.choice(self.config.ops)
        if op == "+":
            c = rng.randint(1, m)
            a = rng.randint(0, c)
            return a, op, c - a, c
        a = rng.randint(1, m)
        b = rng.randint(0, a)
        return a, op, b, a - b

    def make_pair(self, tokenizer, rng, index, n):
        m = self.config.max_value
        shots = "".join("Compute: {} {} {} = {}\n".format(*self._problem(rng)) for _ in range(self.config.n_shots))
        a, op, b, c = self._problem(rng)
        which = rng.choice("ab")
        sign = 1 if op == "+" else -1

        def result(x, y):
            return x + sign * y

        if which == "a":
            options = [x for x in range(m + 1) if x != a and 0 <= result(x, b) <= m]
        else:
            options = [y for y in range(m + 1) if y != b and 0 <= result(a, y) <= m]
        if not options:
            raise PairError(f"[{self.name}] no operand change keeps the result in [0, {m}]")
        new = rng.choice(options)
        c2 = result(new, b) if which == "a" else result(a, new)
        prompt = f"{shots}Compute: {a} {op} {b} ="
        start = len(shots) + len("Compute: ") + (0 if which == "a" else len(f"{a} {op} "))
        old = str(a if which == "a" else b)
        return _pair(self.name, prompt, start, old, str(new), f" {c}", f" {c2}", family="arithmetic", op=op,
                     changed=which)


# ----------------------------------------------------------------------------- binding

@dataclass(frozen=True)
class BindingConfig:
    n_vars: int = 4  # variables bound to distinct digits
    chain: float = 0.5  # probability that the asked variable is a copy ("e = b") of another variable
    n_shots: int = 0  # solved examples before the query (same family, separated by newlines)

    def __post_init__(self):
        _check_int("n_shots", self.n_shots, 0, 10)
        _check_int("n_vars", self.n_vars, 2, 9)
        if not isinstance(self.chain, (int, float)) or not 0.0 <= self.chain <= 1.0:
            raise ValueError(f"chain={self.chain!r}: give a probability in [0, 1]")


class BindingTask(_FewShot, Task):
    name = "binding"
    Config = BindingConfig

    def _query(self, tokenizer, rng):
        k = self.config.n_vars
        names = rng.sample(LETTERS, k + 1)
        values = rng.sample(range(10), k + 1)  # the last one is the corrupt value of the target
        target = rng.randrange(k)
        parts = [f"{v} = {x}" for v, x in zip(names[:k], values[:k])]
        chained = rng.random() < self.config.chain
        asked = names[k] if chained else names[target]
        if chained:
            parts.append(f"{names[k]} = {names[target]}")
        head = "Let " + ", ".join(parts[:target])
        head += ", " if target > 0 else ""
        start = len(head) + len(f"{names[target]} = ")
        prompt = "Let " + ", ".join(parts) + f". Then {asked} ="
        old, new = str(values[target]), str(values[k])
        return _pair(self.name, prompt, start, old, new, f" {old}", f" {new}", family="binding", chained=chained,
                     variable=names[target])


# ----------------------------------------------------------------------------- comparison

@dataclass(frozen=True)
class ComparisonConfig:
    n_people: int = 2
    question: str = "older"  # "older" or "younger"
    n_shots: int = 0  # solved examples before the query (same family, separated by newlines)
    min_gap: int = 1  # years between the oldest (youngest) and the runner-up, in the clean and the corrupt prompt
    name_options: bool = False  # True: "Who is older, Alice or Bob?" (the names in the question, in fact order)

    def __post_init__(self):
        _check_int("n_shots", self.n_shots, 0, 10)
        _check_int("min_gap", self.min_gap, 1, 30)
        _check_int("n_people", self.n_people, 2, 5)
        if self.question not in ("older", "younger"):
            raise ValueError(f"question={self.question!r}: give 'older' or 'younger'")


class ComparisonTask(_FewShot, Task):
    name = "comparison"
    Config = ComparisonConfig

    def _query(self, tokenizer, rng):
        k, older = self.config.n_people, self.config.question == "older"
        people = rng.sample(NAMES, k)
        ages = rng.sample(range(20, 90), k)
        ranked = sorted(range(k), key=lambda i: ages[i], reverse=older)
        win, runner = ranked[0], ranked[1]
        gap = self.config.min_gap
        if abs(ages[win] - ages[runner]) < gap:
            raise PairError(f"[{self.name}] ages {ages[win]} and {ages[runner]} are closer than min_gap={gap}")
        # The winner's age moves past the runner-up's, so the runner-up becomes the answer.
        options = range(20, ages[runner] - gap + 1) if older else range(ages[runner] + gap, 90)
        options = [a for a in options if a not in ages]
        if not options:
            raise PairError(f"[{self.name}] no age moves {people[win]} past {people[runner]}")
        new = rng.choice(options)
        facts = [f"{p} is {a} years old." for p, a in zip(people, ages)]
        options_text = ", " + " or ".join(people) if self.config.name_options else ""
        prompt = " ".join(facts) + f" Who is {self.config.question}{options_text}? Answer:"
        start = len(" ".join(facts[:win])) + (1 if win > 0 else 0) + len(f"{people[win]} is ")
        return _pair(self.name, prompt, start, str(ages[win]), str(new), f" {people[win]}", f" {people[runner]}",
                     family="comparison", changed=people[win])


# ----------------------------------------------------------------------------- two-hop lookup

@dataclass(frozen=True)
class TwoHopConfig:
    n_people: int = 2  # people, each living in a distinct city
    n_shots: int = 0  # solved examples before the query (same family, separated by newlines)
    min_gap: int = 1  # years between the oldest (youngest) and the runner-up, in the clean and the corrupt prompt
    name_options: bool = False  # True: "Who is older, Alice or Bob?" (the names in the question, in fact order)

    def __post_init__(self):
        _check_int("n_shots", self.n_shots, 0, 10)
        _check_int("min_gap", self.min_gap, 1, 30)
        _check_int("n_people", self.n_people, 2, 5)


class TwoHopTask(_FewShot, Task):
    name = "two_hop"
    Config = TwoHopConfig

    def _query(self, tokenizer, rng):
        k = self.config.n_people
        people = rng.sample(NAMES, k)
        places = rng.sample(PLACES, k)
        target = rng.randrange(k)
        other = rng.choice([i for i in range(k) if i != target])
        lives = [f"{p} lives in {c}." for p, (c, _) in zip(people, places)]
        located = [f"{c} is in {country}." for c, country in places]
        rng.shuffle(located)
        prompt = " ".join(lives + located) + f" Which country does {people[target]} live in? Answer:"
        start = len(" ".join(lives[:target])) + (1 if target > 0 else 0) + len(f"{people[target]} lives in ")
        (city, country), (city2, country2) = places[target], places[other]
        return _pair(self.name, prompt, start, city, city2, f" {country}", f" {country2}", family="two_hop",
                     person=people[target])


# ----------------------------------------------------------------------------- mixture

FAMILIES: Registry[type[Task]] = Registry("reasoning family", owner="headscope.tasks.reasoning.FAMILIES")
FAMILIES.register("arithmetic", ArithmeticTask)
FAMILIES.register("binding", BindingTask)
FAMILIES.register("comparison", ComparisonTask)
FAMILIES.register("two_hop", TwoHopTask)


@dataclass(frozen=True)
class ReasoningConfig:
    families: tuple[str, ...] = tuple(FAMILIES)  # sample i comes from families[i % len(families)]

    def __post_init__(self):
        fams = self.families
        if isinstance(fams, str) or not fams or any(f not in FAMILIES for f in fams):
            raise ValueError(f"families={fams!r}: give a non-empty tuple drawn from {tuple(FAMILIES)}")
        object.__setattr__(self, "families", tuple(fams))


class ReasoningTask(Task):
    """An even mixture of the reasoning families, each with its default config."""

    name = "reasoning"
    Config = ReasoningConfig

    def __init__(self, **config):
        super().__init__(**config)
        self.tasks = [FAMILIES[f]() for f in self.config.families]

    def make_pair(self, tokenizer, rng, index, n):
        task = self.tasks[index % len(self.tasks)]
        pair = task.make_pair(tokenizer, rng, index, n)
        return dataclasses.replace(pair, task=self.name)


__all__ = ["ArithmeticTask", "BindingTask", "ComparisonTask", "TwoHopTask", "ReasoningTask", "FAMILIES"]
