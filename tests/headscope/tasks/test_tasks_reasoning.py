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


@pytest.mark.parametrize("name", ["binding", "comparison", "two_hop"])
def test_few_shot_form_keeps_the_alignment(digit_tokenizer, name):
    plain = get_task(name).tokenized(digit_tokenizer, n=6, seed=0)
    shots = get_task(name, n_shots=3).tokenized(digit_tokenizer, n=6, seed=0)
    for tp in shots:
        pair = tp.pair
        prefix = pair.clean_prompt[:pair.changed_spans[0][0]]
        assert pair.meta["n_shots"] == 3 and prefix.count("\n") == 3  # three solved examples, one per line
        assert pair.corrupt_prompt.startswith(prefix)  # the examples are the same in both prompts
        assert tp.diff_pos.min() > 3 and tp.diff_pos.max() < tp.answer_pos[0]
        for line in prefix.split("\n")[:3]:  # each example is solved: its answer follows its question
            assert re.search(r"(Answer:|=) \w+$", line), line
    assert min(t.seq_len for t in shots) > max(t.seq_len for t in plain)
    assert get_task(name, n_shots=0).generate(digit_tokenizer, n=4, seed=0) == \
        get_task(name).generate(digit_tokenizer, n=4, seed=0)  # n_shots=0 is the old form, pair for pair


def test_comparison_min_gap_and_name_options(digit_tokenizer):
    for pair in get_task("comparison", min_gap=30, name_options=True).generate(digit_tokenizer, n=12, seed=0):
        for prompt in (pair.clean_prompt, pair.corrupt_prompt):
            ages = sorted(int(a) for a in re.findall(r"is (\d+) years old", prompt))
            assert ages[-1] - ages[-2] >= 30
            names = re.findall(r"(\w+) is \d+ years old", prompt)
            assert prompt.endswith(f"Who is older, {' or '.join(names)}? Answer:")


@pytest.mark.parametrize("name, config", [("binding", {"n_shots": -1}), ("comparison", {"n_shots": 11}),
                                          ("two_hop", {"n_shots": 1.5}), ("comparison", {"min_gap": 0}),
                                          ("comparison", {"min_gap": 31})])
def test_form_fields_are_validated(name, config):
    field = next(iter(config))
    with pytest.raises(ValueError, match=field):
        get_task(name, **config)
