"""Lengths past a model's positions: said before they run, with an estimate of their time and the fix (a warning
when asked for explicitly or far past the training length, a progress line for the suite's own multiples)."""
import warnings

import pytest

import headscope
import headscope.evaluate.lengths as lengths
import headscope.evaluate.retrieval as retrieval
from headscope.evaluate.lengths import LengthWarning, check_positions, prompt_seconds

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")  # RoPE, max_position_embeddings 256, no training summary: training length 256


@pytest.fixture
def no_runs(monkeypatch):
    """Nothing is scored: the check happens before any length runs."""
    monkeypatch.setattr(retrieval, "by_length", lambda *a, **k: [])


@pytest.mark.parametrize("evaluation, config, prompts", [
    ("niah", {"lengths": (4000,), "depths": (0.0, 1.0), "n": 2}, 4),
    ("niah_multikey", {"lengths": (4000,), "n_keys": (2,), "n": 3}, 3),
    ("template_transfer", {"lengths": (4000,), "phrasings": ("trained",), "n": 1}, 1),
])
def test_an_explicit_length_past_the_positions_warns_with_an_estimate_and_the_fix(model, tok, monkeypatch, no_runs,
                                                                                 evaluation, config, prompts):
    monkeypatch.setattr(lengths, "prompt_seconds", lambda m, L: 60.0)
    with pytest.warns(LengthWarning) as record:
        headscope.evaluate(model, evaluation, tok, configs={evaluation: config}, progress=False)
    (w,) = [r for r in record if issubclass(r.category, LengthWarning)]
    msg = str(w.message)
    assert f"{evaluation}: length 4000 exceeds the model's 256 positions" in msg
    minutes = f"{prompts * 60 / 60:.1f} min" if prompts * 60 >= 90 else f"{prompts * 60} s"
    assert f"estimated about {minutes} for {prompts} prompt" in msg
    assert f"--set {evaluation}.lengths=[128]" in msg and "--budget" in msg and "--time-limit" in msg


def test_lengths_within_the_positions_say_nothing(model, tok, no_runs, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", LengthWarning)
        headscope.evaluate(model, "niah", tok, configs={"niah": {"lengths": (200, 256), "n": 1}}, progress=True)
    assert "positions" not in capsys.readouterr().err


def test_the_suites_own_multiples_get_a_progress_line_not_a_warning(model, tok, no_runs, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", LengthWarning)
        headscope.evaluate(model, "niah", tok, configs={"niah": {"multiples": (1.0, 2.0, 8.0), "n": 1}},
                           progress=True)
    err = capsys.readouterr().err
    assert "niah: lengths 504, 2040 exceed the model's 256 positions" in err and "estimated about" in err


def test_a_multiple_far_past_the_training_length_warns(model, tok, no_runs):
    with pytest.warns(LengthWarning, match="niah: length 4088 exceeds"):
        headscope.evaluate(model, "niah", tok, configs={"niah": {"multiples": (16.0,), "n": 1}}, progress=False)


def test_models_whose_positions_end_are_not_estimated(tok):
    gpt2 = tiny_model("gpt2")  # learned positions: such lengths are "skipped" rows, nothing runs there
    with warnings.catch_warnings():
        warnings.simplefilter("error", LengthWarning)
        assert check_positions(gpt2, "niah", [4000], lambda L: 1, explicit=True) == []


def test_the_estimate_grows_with_the_length(model):
    a, b, n = lengths._fit(model)
    assert a >= 0 and b >= 0 and n == 256
    short, long, longer = (prompt_seconds(model, L) for L in (128, 4096, 65536))
    assert 0 < short < long < longer
    assert longer >= 16 * long * 0.99  # at least linear in the length


def test_headscope_eval_warns_before_running(tmp_path, model_dir, monkeypatch, no_runs, capsys):
    from headscope.cli import main

    monkeypatch.setattr(lengths, "prompt_seconds", lambda m, L: 7200.0)
    with pytest.warns(LengthWarning, match=r"length 99999 exceeds the model's 256 positions.*about 2.0 h"):
        assert main(["eval", "--model", str(model_dir), "--suite", "niah", "--out", str(tmp_path / "r"), "--quiet",
                     "--set", "niah.lengths=[99999]", "--set", "niah.n=1", "--set", "niah.depths=[0.5]"]) == 0
