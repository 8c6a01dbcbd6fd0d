"""Every backend (hf fast path, naive, TransformerLens bridge, nnsight) gives the same scores; metrics."""

import pytest
import torch

from headscope.metrics import resolve_metric
from headscope.patching import HFBackend, NaiveBackend, as_patch_pair, receiver_scores

from model_factories import tiny_model
from patching_pairs import model_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def word_tokenizer(vocab: int = 128):
    """A word-level tokenizer "t0 t1 ..." over the tiny models' ids."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2")


def run(backend, pairs, metric="logit_diff"):
    return receiver_scores(backend, pairs, resolve_metric(metric), progress=False, min_clean_accuracy=0.0)


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_all_backends_agree(family):
    pytest.importorskip("transformer_lens")
    pytest.importorskip("nnsight")
    from nnsight import NNsight

    from headscope.patching.nn_sight import NNsightBackend
    from headscope.patching.tl import TLBackend, bridge_from_hf

    model = tiny_model(family, attn_implementation="sdpa", initializer_range=0.2)
    pairs = [as_patch_pair(model_pair(model, 20, fd, 2, seed=fd, max_effect=True)) for fd in (3, 12)]
    ref = run(HFBackend(model), pairs)
    bridge = bridge_from_hf(model, word_tokenizer())
    for backend in (NaiveBackend(model), TLBackend(bridge), TLBackend(bridge, batch_size=5),
                    NNsightBackend(NNsight(model)), NNsightBackend(NNsight(model), batch_size=7)):
        got = run(backend, pairs)
        assert (got.per_sample_raw - ref.per_sample_raw).abs().max() <= 1e-5, backend.name
        assert torch.allclose(got.clean_metric, ref.clean_metric, atol=1e-5)
        assert torch.allclose(got.corrupt_metric, ref.corrupt_metric, atol=1e-5)


def test_metrics_builtin_and_callable():
    model = tiny_model("qwen3", initializer_range=0.2)
    pair = as_patch_pair(model_pair(model, 16, 4, 2, seed=1))
    logits = NaiveBackend(model).answer_logits(pair.clean_ids, pair.answer_pos)  # [A, V]
    a = torch.arange(2)
    ld = (logits[a, pair.clean_answer_ids] - logits[a, pair.corrupt_answer_ids]).double().mean()
    lp = torch.log_softmax(logits.double(), -1)[a, pair.clean_answer_ids].sum()
    assert torch.allclose(resolve_metric("logit_diff")(logits, pair)[0], ld)
    assert torch.allclose(resolve_metric("logprob")(logits, pair)[0], lp)

    def first_logit(logits_at_answer, pair):  # user metric: sees [A, V] and the original pair object
        assert logits_at_answer.dim() == 2 and hasattr(pair, "clean_ids")
        return float(logits_at_answer[0, pair.clean_answer_ids[0]])

    custom = run(HFBackend(model), [pair], first_logit)
    naive = run(NaiveBackend(model), [pair], first_logit)
    assert custom.settings["metric"] == "first_logit"
    assert (custom.per_sample_raw - naive.per_sample_raw).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="unknown metric"):
        resolve_metric("accuracy")
