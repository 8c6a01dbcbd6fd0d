"""One counterfactual pair, normalized and validated for patching.

``as_patch_pair`` reads anything with the fields of ``headscope.tasks.TokenizedPair`` (clean_ids,
corrupt_ids, answer_pos, clean_answer_ids, corrupt_answer_ids), checks it against the model (vocab
size, context length), recomputes the first differing position and drops the positions after the
last answer position (a causal model's answer logits cannot depend on them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PatchPair", "as_patch_pair", "PatchInputError"]


class PatchInputError(ValueError):
    """A pair that cannot be scored on this model."""


@dataclass(frozen=True)
class PatchPair:
    clean_ids: torch.Tensor  # [T] long
    corrupt_ids: torch.Tensor  # [T] long
    answer_pos: torch.Tensor  # [A] long: logits at answer_pos[i] predict answer token i
    clean_answer_ids: torch.Tensor  # [A] long
    corrupt_answer_ids: torch.Tensor  # [A] long
    first_diff: int  # first position where clean_ids != corrupt_ids
    source: Any = None  # the object this was read from (passed to user metrics)

    def __post_init__(self) -> None:
        T, A = self.clean_ids.shape[0], self.answer_pos.shape[0]
        if self.corrupt_ids.shape != self.clean_ids.shape:
            raise PatchInputError(f"clean_ids has {T} tokens but corrupt_ids has {self.corrupt_ids.shape[0]}: "
                                  "the prompts must tokenize to the same length so positions line up")
        if A == 0 or self.clean_answer_ids.shape[0] != A or self.corrupt_answer_ids.shape[0] != A:
            raise PatchInputError(f"answer_pos ({A}), clean_answer_ids ({self.clean_answer_ids.shape[0]}) and "
                                  f"corrupt_answer_ids ({self.corrupt_answer_ids.shape[0]}) must have the same "
                                  "non-zero length")
        if int(self.answer_pos.min()) < 0 or int(self.answer_pos.max()) >= T:
            raise PatchInputError(f"answer_pos {self.answer_pos.tolist()} is outside the {T} input positions")
        if not 0 <= self.first_diff < T:
            raise PatchInputError(f"first_diff={self.first_diff} is outside 0..{T - 1}")

    @property
    def seq_len(self) -> int:
        return self.clean_ids.shape[0]


def _long(x: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() != 1:
        raise PatchInputError(f"{name} must be a 1-D tensor of token ids/positions, got shape {tuple(t.shape)}")
    return t.long().cpu()


def as_patch_pair(obj: Any, vocab_size: int | None = None, max_positions: int | None = None) -> PatchPair:
    """Normalize and validate one TokenizedPair-like object for a model with the given limits."""
    if isinstance(obj, PatchPair):
        obj = obj.source if obj.source is not None else obj
    missing = [f for f in ("clean_ids", "corrupt_ids", "answer_pos", "clean_answer_ids", "corrupt_answer_ids")
               if not hasattr(obj, f)]
    if missing:
        raise PatchInputError(f"{type(obj).__name__} lacks {missing}; pass headscope.tasks.TokenizedPair objects "
                              "(task.tokenized(tokenizer, n, seed)) or a task name")
    clean, corrupt = _long(obj.clean_ids, "clean_ids"), _long(obj.corrupt_ids, "corrupt_ids")
    answer_pos = _long(obj.answer_pos, "answer_pos")
    clean_ans, corrupt_ans = _long(obj.clean_answer_ids, "clean_answer_ids"), _long(obj.corrupt_answer_ids,
                                                                                   "corrupt_answer_ids")
    if clean.shape != corrupt.shape:
        raise PatchInputError(f"clean_ids has {clean.shape[0]} tokens but corrupt_ids has {corrupt.shape[0]}: "
                              "the prompts must tokenize to the same length so positions line up")
    if max_positions is not None and clean.shape[0] > max_positions:
        raise PatchInputError(f"the prompt has {clean.shape[0]} tokens but the model's context is {max_positions} "
                              "(config.max_position_embeddings / n_positions); use a shorter context_length "
                              "in the task config")
    if vocab_size is not None:
        for name, t in (("clean_ids", clean), ("corrupt_ids", corrupt), ("clean_answer_ids", clean_ans),
                        ("corrupt_answer_ids", corrupt_ans)):
            bad = ((t >= vocab_size) | (t < 0)).nonzero().flatten()  # [B]
            if bad.numel():
                pos = int(bad[0])
                raise PatchInputError(f"{name}[{pos}] is token id {int(t[pos])}, outside the model's vocabulary "
                                      f"(ids 0..{vocab_size - 1}; {bad.numel()} such id(s)): the tokenizer does "
                                      "not match the model; pass the model's own tokenizer")
    diff = (clean != corrupt).nonzero().flatten()  # [P]
    if diff.numel() == 0:
        raise PatchInputError("clean_ids and corrupt_ids are identical: the corruption changes no token, so "
                              "no head can carry its effect; check the task's corruption")
    first_diff = int(diff[0])
    if int(answer_pos.min()) < first_diff:
        raise PatchInputError(f"answer position {int(answer_pos.min())} comes before the first corrupted token "
                              f"({first_diff}): the corruption cannot reach that answer logit in a causal model")
    end = int(answer_pos.max()) + 1  # positions after the last answer logit cannot matter
    return PatchPair(clean_ids=clean[:end], corrupt_ids=corrupt[:end], answer_pos=answer_pos,
                     clean_answer_ids=clean_ans, corrupt_answer_ids=corrupt_ans, first_diff=first_diff, source=obj)
