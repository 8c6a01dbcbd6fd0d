"""Reasoning families: the changed fact flips the answer, positions align, prompts stay short."""
from __future__ import annotations

import re

import pytest

from headscope.tasks import get_task

FAMILIES = ["arithmetic", "binding", "comparison", "two_hop"]


@pytest.mark.parametrize("name", FAMILIES + ["reasoning"])
def test_family_pairs_are_valid(tokenizer, name):
    tps = get_task(name).tokenized(tokenizer, n=12, seed=0)
    for tp in tps:
        pair = tp.pair
        assert pair.task == name and pair.meta["family"] in FAMILIES
        assert pair.clean_answer != pair.corrupt_answer
        assert pair.clean_answer.strip()[0] != pair.corrupt_answer.strip()[0]
        assert tp.clean_answer_ids[0] != tp.corrupt_answer_ids[0]
        assert 8 <= tp.seq_len <= 100
        assert set(tp.diff_pos.tolist()) and tp.diff_pos.max() < tp.answer_pos[0]


@pytest.mark.parametrize("name", FAMILIES + ["reasoning"])
def test_determinism(digit_tokenizer, name):
    task = get_task(name)
    assert task.generate(digit_tokenizer, n=6, seed=3) == task.generate(digit_tokenizer, n=6, seed=3)
    assert task.generate(digit_tokenizer, n=6, seed=3) != task.generate(digit_tokenizer, n=6, seed=4)


def test_arithmetic_answers_are_correct(digit_tokenizer):
    for pair in get_task("arithmetic", n_shots=1).generate(digit_tokenizer, n=20, seed=0):
        for prompt, answer in ((pair.clean_prompt, pair.clean_answer), (pair.corrupt_prompt, pair.corrupt_answer)):
            a, op, b = re.findall(r"Compute: (\d) ([+-]) (\d) =$", prompt)[0]
            assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_binding_answers_follow_the_binding(digit_tokenizer):
    for pair in get_task("binding", chain=0.5).generate(digit_tokenizer, n=20, seed=0):
        for prompt, answer in ((pair.clean_prompt, pair.clean_answer), (pair.corrupt_prompt, pair.corrupt_answer)):
            env = dict(re.findall(r"(\w) = (\w)", prompt.split(". Then")[0]))
            asked = prompt.rsplit("Then ", 1)[1][0]
            value = env[asked]
            value = env.get(value, value)  # follow one copy
            assert answer == f" {value}"


def test_comparison_answers_are_the_oldest(digit_tokenizer):
    for question in ("older", "younger"):
        for pair in get_task("comparison", n_people=3, question=question).generate(digit_tokenizer, n=10, seed=0):
            for prompt, answer in ((pair.clean_prompt, pair.clean_answer), (pair.corrupt_prompt, pair.corrupt_answer)):
                ages = {p: int(a) for p, a in re.findall(r"(\w+) is (\d+) years old", prompt)}
                pick = max if question == "older" else min
                assert answer == f" {pick(ages, key=ages.get)}"


def test_two_hop_answers_follow_both_hops(digit_tokenizer):
    for pair in get_task("two_hop", n_people=3).generate(digit_tokenizer, n=10, seed=0):
        for prompt, answer in ((pair.clean_prompt, pair.clean_answer), (pair.corrupt_prompt, pair.corrupt_answer)):
            lives = dict(re.findall(r"(\w+) lives in (\w+)\.", prompt))
            country = dict(re.findall(r"(\w+) is in (\w+)\.", prompt))
            person = re.findall(r"Which country does (\w+) live in", prompt)[0]
            assert answer == f" {country[lives[person]]}"


def test_mixture_is_even(digit_tokenizer):
    pairs = get_task("reasoning").generate(digit_tokenizer, n=8, seed=0)
    assert [p.meta["family"] for p in pairs] == FAMILIES * 2
    only = get_task("reasoning", families=("binding",)).generate(digit_tokenizer, n=3)
    assert {p.meta["family"] for p in only} == {"binding"}


def test_bad_reasoning_configs():
    for name, kwargs, field in (("arithmetic", dict(ops="*"), "ops='\\*'"), ("comparison", dict(question="taller"),
                                "question='taller'"), ("two_hop", dict(n_people=9), "n_people=9"),
                                ("reasoning", dict(families=("poetry",)), "families=")):
        with pytest.raises(ValueError, match=field):
            get_task(name, **kwargs)
