"""score(): task names, pair lists, backend detection, and the errors a user can hit."""
import pytest
import torch

from headscope.api import score
from headscope.arch import UnsupportedModelError
from headscope.patching import PatchInputError

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_score_niah_by_name_is_deterministic():
    model, tok = tiny_model("qwen3", initializer_range=0.2), char_tokenizer()
    with pytest.warns(UserWarning, match="correctly"):  # a random model fails the clean task: warned
        a = score(model, "niah", tokenizer=tok, n_samples=2, seed=3, progress=False, context_length=160)
    b = score(model, "niah", tokenizer=tok, n_samples=2, seed=3, progress=False, context_length=160,
              on_clean_failure="warn", min_clean_accuracy=0.0)
    assert a.task == "niah" and a.per_sample_raw.shape == (2, 3, 4)
    assert torch.equal(a.per_sample_raw, b.per_sample_raw)
    assert a.settings["task_config"] == {"context_length": 160} and a.settings["backend"] == "hf"
    naive = score(model, "niah", tokenizer=tok, n_samples=2, seed=3, progress=False, backend="naive",
                  task_config={"context_length": 160}, min_clean_accuracy=0.0)
    assert (naive.per_sample_raw - a.per_sample_raw).abs().max() <= 1e-4


def test_score_accepts_pair_list_and_wrappers():
    pytest.importorskip("nnsight")
    from nnsight import NNsight

    from headscope.tasks import get_task

    model, tok = tiny_model("qwen3", initializer_range=0.2), char_tokenizer()
    pairs = get_task("niah", context_length=160).tokenized(tok, 1, 0)
    hf = score(model, pairs, progress=False, min_clean_accuracy=0.0)
    wrapped = score(NNsight(model), pairs, progress=False, min_clean_accuracy=0.0)  # auto -> nnsight backend
    assert wrapped.settings["backend"] == "nnsight"
    assert (wrapped.per_sample_raw - hf.per_sample_raw).abs().max() <= 1e-4


def test_errors_name_the_problem():
    model, tok = tiny_model("qwen3"), char_tokenizer()
    with pytest.raises(LookupError, match="unknown task 'nope'"):
        score(model, "nope", tokenizer=tok, progress=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        score(model, "niah", progress=False, context_length=64)
    with pytest.raises(PatchInputError, match="context is 256"):
        score(model, "niah", tokenizer=tok, n_samples=1, progress=False, context_length=400)
    with pytest.raises(PatchInputError, match="does not match the model"):
        score(tiny_model("qwen3", vocab_size=64), "niah", tokenizer=tok, n_samples=1, progress=False,
              context_length=64)
    with pytest.raises(UnsupportedModelError, match="supported families"):
        score(_NoHeads(), "niah", tokenizer=tok, progress=False)
    with pytest.raises(ValueError, match="backend="):
        score(model, "niah", tokenizer=tok, n_samples=1, progress=False, backend="jax", context_length=160)


class _NoHeads(torch.nn.Module):
    """A model with a config but no attention layout headscope knows."""

    def __init__(self):
        super().__init__()
        import transformers as tf

        self.config = tf.PretrainedConfig(model_type="mystery")
        self.body = torch.nn.Linear(4, 4)


def test_out_of_vocabulary_ids_name_the_pair_and_the_id():
    import dataclasses

    from headscope.tasks import get_task

    model, tok = tiny_model("qwen3"), char_tokenizer()
    pairs = get_task("niah", context_length=160).tokenized(tok, 2, 0)
    ids = list(pairs[1].corrupt_ids)
    ids[5] = 500
    bad = dataclasses.replace(pairs[1], corrupt_ids=type(pairs[1].corrupt_ids)(ids) if isinstance(
        pairs[1].corrupt_ids, list) else torch.as_tensor(ids))
    with pytest.raises(PatchInputError, match=r"pair 1 of 'niah'.*corrupt_ids\[5\] is token id 500, outside the "
                                              r"model's vocabulary \(ids 0..127"):
        score(model, [pairs[0], bad], progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA is not available"):
        score(tiny_model("qwen3"), "niah", tokenizer=char_tokenizer(), device="cuda", progress=False,
              context_length=160)


def _three_pair_task():
    from headscope.tasks import from_pairs

    return from_pairs("three", [(f"a b the number is {a} c the answer is", f"a b the number is {b} c the answer is",
                                 f" {a}", f" {b}") for a, b in ((1, 2), (3, 4), (5, 6))])


def test_n_samples_none_means_all_pairs_and_a_larger_count_is_refused():
    from char_tokenizer import word_tokenizer

    model, tok, task = tiny_model("qwen3"), word_tokenizer(), _three_pair_task()
    for call in (lambda: score(model, task, tokenizer=tok, progress=False),  # the default 8 > 3 pairs
                 lambda: score(model, task, tokenizer=tok, n_samples=5, progress=False)):
        with pytest.raises(ValueError, match=r"n_samples=(8|5) but task 'three' holds 3 pairs; pass n_samples=None"):
            call()
    s = score(model, task, tokenizer=tok, n_samples=None, progress=False, min_clean_accuracy=0.0)
    assert s.n_samples == 3 and s.settings["n_samples"] == 3
    assert score(model, task, tokenizer=tok, n_samples=2, progress=False, min_clean_accuracy=0.0).n_samples == 2
    pairs = task.tokenized(tok)  # n=None: all pairs
    assert len(pairs) == 3 and score(model, pairs, tokenizer=tok, n_samples=None, progress=False,
                                     min_clean_accuracy=0.0).n_samples == 3
    from headscope.tasks import register_task

    register_task("three_test", _three_pair_task, overwrite=True)  # a fixed set given by name
    with pytest.raises(ValueError, match="holds 3 pairs; pass n_samples=None"):
        score(model, "three_test", tokenizer=tok, progress=False)
    assert score(model, "three_test", tokenizer=tok, n_samples=None, progress=False,
                 min_clean_accuracy=0.0).n_samples == 3
    with pytest.raises(ValueError, match="n_samples=None means all pairs, but task 'niah' generates pairs"):
        score(model, "niah", tokenizer=tok, n_samples=None, progress=False, context_length=64)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="n_samples must be an int >= 1"):
            score(model, task, tokenizer=tok, n_samples=bad, progress=False)
    with pytest.raises(ValueError, match="holds 3 pairs; pass n=None for all 3 \\(n_samples=None"):
        task.generate(tok, n=4)


def test_sender_scores_follow_the_n_samples_rule():
    from char_tokenizer import word_tokenizer
    from headscope.senders import sender_scores

    model, tok, task = tiny_model("qwen3"), word_tokenizer(), _three_pair_task()
    with pytest.raises(ValueError, match="holds 3 pairs; pass n_samples=None"):
        sender_scores(model, task, [(2, 0)], tokenizer=tok, progress=False)
    s = sender_scores(model, task, [(2, 0)], tokenizer=tok, n_samples=None, progress=False, min_clean_accuracy=0.0)
    assert s.n_samples == 3
