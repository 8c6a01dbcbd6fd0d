"""The engine's checks: clean failure (warn/drop/error), degenerate pairs, input validation."""
import pytest
import torch

from headscope.metrics import resolve_metric
from headscope.patching import (CleanFailureError, DegeneratePairError, HFBackend, PatchInputError,
                                as_patch_pair, receiver_scores)

from model_factories import tiny_model
from patching_pairs import make_pair, model_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", initializer_range=0.2)


def good_and_bad(model):
    good = model_pair(model, 16, 4, 2, seed=0)  # clean answer = the model's argmax: correct
    bad = model_pair(model, 16, 4, 2, seed=1)
    bad.clean_answer_ids, bad.corrupt_answer_ids = bad.corrupt_answer_ids, bad.clean_answer_ids  # wrong
    return [as_patch_pair(good), as_patch_pair(bad)]


def score(model, pairs, **kw):
    return receiver_scores(HFBackend(model), pairs, resolve_metric("logit_diff"), progress=False, **kw)


def test_clean_failure_modes(model):
    pairs = good_and_bad(model)
    with pytest.warns(UserWarning, match="50%"):
        s = score(model, pairs, min_clean_accuracy=0.9)
    assert s.n_samples == 2 and s.clean_correct.tolist() == [True, False] and s.clean_accuracy == 0.5
    with pytest.warns(UserWarning, match="dropped 1 of 2"):
        s = score(model, pairs, on_clean_failure="drop")
    assert s.n_samples == 1 and s.settings["dropped"] == {"1": "clean answer wrong"}
    with pytest.raises(CleanFailureError, match="on_clean_failure"):
        score(model, pairs, on_clean_failure="error", min_clean_accuracy=0.9)
    with pytest.raises(CleanFailureError, match="none of the 1"):
        score(model, pairs[1:], on_clean_failure="drop")
    with pytest.raises(ValueError, match="on_clean_failure"):
        score(model, pairs, on_clean_failure="ignore")


def test_scores_are_normalized(model):
    s = score(model, good_and_bad(model)[:1])
    assert s.clean_metric[0] > s.corrupt_metric[0]
    assert s.per_sample_raw.shape == (1, 3, 4) and s.per_sample_raw.abs().max() > 0
    assert s.settings["backend"] == "hf" and s.settings["metric"] == "logit_diff"


def test_degenerate_pairs(model):
    good = good_and_bad(model)[0]
    flat = make_pair(16, 4, 2, seed=5)
    flat.corrupt_answer_ids = flat.clean_answer_ids.clone()  # logit diff is 0 in both runs
    flat = as_patch_pair(flat)
    with pytest.warns(UserWarning, match="does not change the metric"):
        s = score(model, [good, flat], min_clean_accuracy=0.0)
    assert s.n_samples == 1
    with pytest.raises(DegeneratePairError, match="corruption does not change"):
        score(model, [flat], min_clean_accuracy=0.0)


def test_input_validation():
    p = make_pair(16, 4, 2, seed=0)
    with pytest.raises(PatchInputError, match=r"clean_ids\[\d+\] is token id \d+, outside the model.s vocabulary \(ids 0..99"):
        as_patch_pair(p, vocab_size=100) if int(p.clean_ids.max()) >= 100 else as_patch_pair(
            make_pair(16, 4, 2, seed=0, vocab=128).__class__(**{**vars(p), "clean_ids": p.clean_ids + 100}),
            vocab_size=100)
    with pytest.raises(PatchInputError, match="context is 8"):
        as_patch_pair(p, max_positions=8)
    same = make_pair(16, 4, 2, seed=0)
    same.corrupt_ids = same.clean_ids.clone()
    with pytest.raises(PatchInputError, match="identical"):
        as_patch_pair(same)
    short = make_pair(16, 4, 2, seed=0)
    short.corrupt_ids = short.corrupt_ids[:-1]
    with pytest.raises(PatchInputError, match="same length"):
        as_patch_pair(short)
    late = make_pair(16, 4, 2, seed=0)
    late.answer_pos = torch.tensor([2, 3])
    with pytest.raises(PatchInputError, match="before the first corrupted token"):
        as_patch_pair(late)
    trimmed = as_patch_pair(make_pair(16, 4, 2, seed=0).__class__(**{**vars(p), "answer_pos": torch.tensor([9, 10])}))
    assert trimmed.seq_len == 11  # positions after the last answer logit are dropped
