"""NIAH pairs: context length, depth placement, values, multikey, determinism."""
from __future__ import annotations

import re

import pytest
import torch

from headscope.tasks import PairError, get_task, load_haystack, tokenize_pair
from headscope.tasks.niah import NEEDLE, QUESTION


@pytest.mark.parametrize("context_length", [128, 600])
def test_context_length_and_layout(tokenizer, context_length):
    tps = get_task("niah", context_length=context_length).tokenized(tokenizer, n=3, seed=0)
    for tp in tps:
        n_prompt = len(tokenizer(tp.pair.clean_prompt).input_ids)
        assert 0.98 * context_length <= n_prompt <= context_length
        assert tp.pair.meta["prompt_tokens"] == n_prompt
        assert tp.pair.clean_prompt.endswith(QUESTION)
        assert tp.clean_ids.shape == tp.corrupt_ids.shape
        assert tp.answer_pos[-1].item() == tp.seq_len - 1  # the last position predicts the last answer token
        assert tp.first_diff < tp.answer_pos[0]


def test_needle_value_and_corruption(tokenizer):
    for pair in get_task("niah", context_length=200).generate(tokenizer, n=4, seed=1):
        (s, e), = pair.changed_spans
        value, corrupt_value = pair.clean_prompt[s:e], pair.corrupt_prompt[s:e]
        assert pair.clean_answer == f" {value}" and pair.corrupt_answer == f" {corrupt_value}"
        assert len(value) == 4 and value.isdigit() and value[0] != corrupt_value[0]
        assert NEEDLE.format(value=value) in pair.clean_prompt
        assert pair.clean_prompt[:s] == pair.corrupt_prompt[:s] and pair.clean_prompt[e:] == pair.corrupt_prompt[e:]


def test_fixed_values(digit_tokenizer):
    pair = get_task("niah", context_length=100, random_values=False).generate(digit_tokenizer, n=1)[0]
    assert (pair.clean_answer, pair.corrupt_answer) == (" 4321", " 8765")


def test_determinism_per_seed(tokenizer):
    task = get_task("niah", context_length=160, depth="random")
    a, b = task.generate(tokenizer, n=3, seed=5), task.generate(tokenizer, n=3, seed=5)
    assert a == b and [p.meta for p in a] == [p.meta for p in b]
    assert a != task.generate(tokenizer, n=3, seed=6)
    assert task.generate(tokenizer, n=2, seed=5) == a[:2]  # sample i does not depend on n


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_depth_placement(digit_tokenizer, depth):
    tp = get_task("niah", context_length=400, depth=depth).tokenized(digit_tokenizer, n=1, seed=2)[0]
    assert abs(tp.pair.meta["needle_depth"] - depth) < 0.1
    assert abs(tp.first_diff / tp.prompt_len - depth) < 0.12  # the value's tokens sit at that depth


def test_uniform_depths_spread(digit_tokenizer):
    pairs = get_task("niah", context_length=200, depth="uniform").generate(digit_tokenizer, n=5, seed=0)
    assert [p.meta["depth"] for p in pairs] == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_distractor_needles(digit_tokenizer):
    pair = get_task("niah", context_length=300, n_needles=3).generate(digit_tokenizer, n=1, seed=0)[0]
    assert pair.clean_prompt.count("The special magic number for ") == 2
    assert len(pair.meta["distractor_keys"]) == 2


def test_multikey_changes_only_the_asked_value(tokenizer):
    for pair in get_task("niah_multikey", context_length=300, n_keys=4).generate(tokenizer, n=3, seed=0):
        key = pair.meta["key"]
        assert pair.clean_prompt.endswith(f"for {key}? Answer: The special magic number for {key} is")
        assert pair.clean_prompt.count("The special magic number for ") == 4 + 1  # 4 needles + the answer stub
        (s, e), = pair.changed_spans
        assert pair.clean_prompt[:s].endswith(f"The special magic number for {key} is ")
        tokenize_pair(tokenizer, pair)


def test_haystack_sources(digit_tokenizer, tmp_path):
    text = load_haystack("heldout")
    assert len(text) > 100_000 and "Gutenberg" not in text
    path = tmp_path / "hay.txt"
    path.write_text("The sea is calm tonight. The tide is full, the moon lies fair.\n\n" * 200)
    pair = get_task("niah", context_length=128, haystack=str(path)).generate(digit_tokenizer, n=1)[0]
    assert "The tide is full" in pair.clean_prompt
    with pytest.raises(ValueError, match="haystack='nowhere.txt'"):
        get_task("niah", haystack="nowhere.txt")


def test_haystack_missing_path_and_non_utf8_file_are_refused(digit_tokenizer, tmp_path):
    missing = str(tmp_path / "no_such_dir" / "hay")  # path-like, no .txt: still a path, never the text itself
    for bad in (missing, "corpus/hay.txt", "nowhere.TXT"):
        with pytest.raises(ValueError, match=rf"haystack={re.escape(repr(bad))}: no such file.*check the path"):
            load_haystack(bad)
    with pytest.raises(ValueError, match="no such file"):
        get_task("niah", context_length=128, haystack=missing)
    with pytest.raises(ValueError, match="not a regular file"):
        load_haystack(str(tmp_path))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("Caf\xe9 au lait. The tide is full.\n\n".encode("latin-1") * 200)
    for source in (str(latin), latin):  # a str path and an os.PathLike
        with pytest.raises(ValueError, match=rf"haystack file {re.escape(str(latin))} is not UTF-8.*convert it to UTF-8"):
            load_haystack(source)
    with pytest.raises(ValueError, match="is not UTF-8"):
        get_task("niah", context_length=128, haystack=str(latin)).generate(digit_tokenizer, n=1)
    good = tmp_path / "utf8.txt"
    good.write_text("Caf\xe9 au lait. The tide is full.\n\n" * 200, encoding="utf-8")
    assert load_haystack(good) == load_haystack(str(good))
    text = "The sea is calm tonight. The tide is full, the moon lies fair.\n\n" * 20  # literal text still works
    assert load_haystack(text) == text
    prose = "A line of prose with a slash, and/or more: " * 10  # one line, >= 200 chars, with spaces: text
    assert load_haystack(prose) == prose


def test_too_small_context_is_a_clear_error(digit_tokenizer):
    with pytest.raises(PairError, match="context_length=40.*Fix: raise context_length"):
        get_task("niah_multikey", context_length=40, n_keys=6).generate(digit_tokenizer, n=1)


def test_bad_niah_configs():
    for kwargs, field in ((dict(context_length=8), "context_length=8"), (dict(depth="middle"), "depth='middle'"),
                          (dict(value_digits=0), "value_digits=0"), (dict(n_keys=0), "n_keys=0")):
        with pytest.raises(ValueError, match=field):
            get_task("niah_multikey", **kwargs)


def test_token_ids_are_long(digit_tokenizer):
    tp = get_task("niah", context_length=64).tokenized(digit_tokenizer, n=1)[0]
    assert tp.clean_ids.dtype == torch.long and tp.answer_pos.dtype == torch.long


def test_sample_alone_is_what_generate_holds(tokenizer):
    task = get_task("niah", context_length=160, depth="uniform")
    pairs = task.generate(tokenizer, n=3, seed=4)
    assert [task.sample(tokenizer, i, 3, 4)[0] for i in range(3)] == pairs


def test_is_heldout_value():
    from headscope.tasks.niah import is_heldout_value

    assert is_heldout_value(" 4900") and not is_heldout_value(" 4901") and not is_heldout_value(" Alice")
