"""Needle and question phrasings for single-key NIAH: the trained template and others ("template transfer").

The reference model was trained on one template (``headscope.tasks.niah.NEEDLE`` / ``QUESTION``: "The special
magic number is 4321." ... "Question: What is the special magic number? Answer: The special magic number is").
The other phrasings share no wording with it beyond the value, so accuracy on them cannot come from memorised
wording. Every question ends in "Answer: <prefix>" and the answer is " <value>".
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from headscope.registry import Registry
from headscope.tasks.niah import NEEDLE, QUESTION, NiahConfig, NiahTask

__all__ = ["PHRASINGS", "PhrasedNiahConfig", "PhrasedNiahTask"]

PHRASINGS: Registry[tuple[str, str]] = Registry("phrasing", owner="headscope.evaluate.phrasings.PHRASINGS")
PHRASINGS.register("trained", (NEEDLE, QUESTION))
PHRASINGS.register("code", ("The secret code of the old lock is {value}.",
                            "\nQuestion: Which secret code opens the old lock? Answer: The secret code of the old lock "
                            "is"))
PHRASINGS.register("pin", ("Remember this: the PIN for the vault is {value}.",
                           "\nQuestion: What PIN did the text give for the vault? Answer: The PIN for the vault is"))
PHRASINGS.register("plain", ("Note that the value hidden here is {value}.",
                             "\n\nWhat value was hidden in the text above? Answer: The hidden value is"))


@dataclass(frozen=True)
class PhrasedNiahConfig(NiahConfig):
    phrasing: str = "trained"

    def __post_init__(self):
        super().__post_init__()
        if self.phrasing not in PHRASINGS:
            raise ValueError(f"phrasing={self.phrasing!r}: give one of {sorted(PHRASINGS)}")


class PhrasedNiahTask(NiahTask):
    """Single-key NIAH (one needle) in one of ``PHRASINGS``; "trained" is exactly the "niah" task."""

    name = "niah_phrased"
    Config = PhrasedNiahConfig

    def _needles(self, rng: random.Random):
        if self.config.n_needles != 1:
            raise ValueError("PhrasedNiahTask takes one needle (n_needles=1)")
        needle, question = PHRASINGS[self.config.phrasing]
        return [None], [needle], question
