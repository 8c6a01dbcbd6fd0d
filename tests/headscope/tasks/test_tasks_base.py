"""tokenize_pair layout and validation, from_pairs, and the task registry."""
from __future__ import annotations

import pytest
import torch

from headscope.tasks import (PairError, PromptPair, Task, TokenizedPair, UnknownTaskError, from_pairs, get_task,
                             list_tasks, register_task, tokenize_pair)


def _pair(clean="Let a = 4, b = 7. Then b =", corrupt="Let a = 4, b = 3. Then b =", answers=(" 7", " 3")):
    s = clean.index("7")
    return PromptPair(clean, corrupt, answers[0], answers[1], ((s, s + 1),), task="unit")


def test_teacher_forced_layout(tokenizer):
    pair = _pair(answers=(" 7 apples", " 3 apples"))
    tp = tokenize_pair(tokenizer, pair)
    prompt = tokenizer(pair.clean_prompt).input_ids  # includes BOS when the tokenizer adds one
    full = tokenizer(pair.clean_prompt + pair.clean_answer).input_ids
    answer = full[len(prompt):]
    assert isinstance(tp, TokenizedPair)
    assert tp.clean_ids.tolist() == prompt + answer[:-1]
    assert tp.clean_ids.shape == tp.corrupt_ids.shape
    assert tp.corrupt_ids[len(prompt):].tolist() == answer[:-1]  # the clean answer is teacher-forced in both runs
    assert tp.clean_answer_ids.tolist() == answer
    assert tp.answer_pos.tolist() == [len(prompt) - 1 + i for i in range(len(answer))]
    assert tp.clean_answer_ids[0] != tp.corrupt_answer_ids[0]
    assert tp.clean_answer_ids[1:].tolist() == tp.corrupt_answer_ids[1:].tolist()
    diff = (tp.clean_ids != tp.corrupt_ids).nonzero().flatten().tolist()
    assert tp.diff_pos.tolist() == diff and tp.first_diff == diff[0]


def test_bos_only_when_the_tokenizer_adds_one(digit_tokenizer, bytelevel_tokenizer):
    assert tokenize_pair(digit_tokenizer, _pair()).clean_ids[0].item() == digit_tokenizer.bos_token_id
    tp = tokenize_pair(bytelevel_tokenizer, _pair())
    assert tp.clean_ids.tolist()[: 3] == bytelevel_tokenizer("Let a =", add_special_tokens=False).input_ids[:3]


def test_shared_leading_answer_tokens_move_into_prompt(metaspace_tokenizer):
    tok = metaspace_tokenizer
    tp = tokenize_pair(tok, _pair())
    assert tok.convert_ids_to_tokens(tp.clean_ids[-1:].tolist()) == ["▁"]  # the lone "▁" before a digit
    assert tok.convert_ids_to_tokens(tp.clean_answer_ids.tolist()) == ["7"]
    assert tp.answer_pos.tolist() == [tp.prompt_len - 1]


def test_unequal_values_raise_with_fix(bytelevel_tokenizer):
    clean, corrupt = "The special magic number is 7.", "The special magic number is 7123456.", 
    s = clean.index("7")
    pair = PromptPair(clean, corrupt, " 7", " 7123456", ((s, s + 1),), task="unit")
    with pytest.raises(PairError, match=r"\[unit\].*tokens.*Fix"):
        tokenize_pair(bytelevel_tokenizer, pair)


def test_answers_must_differ_and_match_in_length(digit_tokenizer):
    with pytest.raises(PairError, match="both ' 7'.*must change the answer"):
        tokenize_pair(digit_tokenizer, _pair(answers=(" 7", " 7")))
    with pytest.raises(PairError, match="equal token counts"):
        tokenize_pair(digit_tokenizer, _pair(answers=(" 7", " 33")))


def test_change_outside_span_is_rejected(digit_tokenizer):
    clean, corrupt = "Let a = 4, b = 7. Then b =", "Let a = 5, b = 3. Then b ="
    s = clean.index("7")
    pair = PromptPair(clean, corrupt, " 7", " 3", ((s, s + 1),), task="unit")
    with pytest.raises(PairError, match="differ outside changed_spans"):
        tokenize_pair(digit_tokenizer, pair)
    # The text agrees outside the span but the span is declared too narrow: caught on tokens.
    narrow = PromptPair(clean, corrupt, " 7", " 3", ((clean.index("4"), s + 1),), task="unit")
    assert tokenize_pair(digit_tokenizer, narrow).diff_pos.numel() == 2
    wrong = PromptPair(clean, corrupt, " 7", " 3", ((clean.index("4"), clean.index("4") + 1),), task="unit")
    with pytest.raises(PairError, match="differ outside changed_spans"):
        tokenize_pair(digit_tokenizer, wrong)


class _SlowView:
    """A tokenizer without offset mappings (is_fast False) to exercise the token-wise fallback."""

    is_fast = False

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text, add_special_tokens=True, **kw):
        kw.pop("return_offsets_mapping", None)
        return self.tok(text, add_special_tokens=add_special_tokens, **kw)


def test_slow_tokenizer_fallback(digit_tokenizer):
    slow = _SlowView(digit_tokenizer)
    fast_tp, slow_tp = tokenize_pair(digit_tokenizer, _pair()), tokenize_pair(slow, _pair())
    assert torch.equal(fast_tp.clean_ids, slow_tp.clean_ids) and torch.equal(fast_tp.diff_pos, slow_tp.diff_pos)


def test_from_pairs_infers_span_and_tokenizes(tokenizer):
    task = from_pairs("mine", [("Tom has 3 cats and 2 dogs. Tom has", "Tom has 8 cats and 2 dogs. Tom has", " 3", " 8"),
                               ("Let x = 2. Then x =", "Let x = 5. Then x =", " 2", " 5")])
    pairs = task.generate(tokenizer)
    assert [p.task for p in pairs] == ["mine", "mine"]
    assert pairs[0].changed_spans == ((8, 9),) and pairs[1].changed_spans == ((8, 9),)
    tps = task.tokenized(tokenizer, n=1, seed=3)
    assert len(tps) == 1 and tps[0].diff_pos.numel() >= 1
    with pytest.raises(ValueError, match="holds 2 pairs"):
        task.generate(tokenizer, n=5)
    with pytest.raises(PairError, match="identical"):
        from_pairs("same", [("a b c", "a b c", " x", " y")])
    with pytest.raises(ValueError, match="give \\(clean, corrupt"):
        from_pairs("bad", [("a", "b")])


def test_registry_unknown_and_custom():
    with pytest.raises(UnknownTaskError, match="unknown task 'nope'.*niah.*reasoning"):
        get_task("nope")
    assert {"niah", "niah_multikey", "arithmetic", "binding", "comparison", "two_hop", "reasoning"} <= set(list_tasks())

    class Echo(Task):
        name = "echo_test"

        def make_pair(self, tokenizer, rng, index, n):
            a, b = rng.sample(range(1, 10), 2)
            return PromptPair(f"Say {a}:", f"Say {b}:", f" {a}", f" {b}", ((4, 5),), task=self.name)

    register_task("echo_test", Echo)
    assert "echo_test" in list_tasks() and isinstance(get_task("echo_test"), Echo)
    with pytest.raises(ValueError, match="factory"):
        register_task("broken", 3)


def test_bad_config_names_field():
    with pytest.raises(ValueError, match="no config field.*'colour'"):
        get_task("niah", colour="red")
    with pytest.raises(ValueError, match="depth=1.5"):
        get_task("niah", depth=1.5)
    with pytest.raises(ValueError, match="n_vars=1"):
        get_task("binding", n_vars=1)


def test_generate_rejects_bad_n(digit_tokenizer):
    with pytest.raises(ValueError, match="n=0"):
        get_task("arithmetic").generate(digit_tokenizer, n=0)
