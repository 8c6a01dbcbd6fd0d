"""headscope.senders: sender_scores and iterated_path_patching (task handling, rounds, combination, errors)."""
import pytest
import torch

from headscope.api import score
from headscope.fusion import combine
from headscope.heads import Head
from headscope.senders import PathPatchingResult, default_k, iterated_path_patching, sender_scores

from char_tokenizer import char_tokenizer
from model_factories import tiny_model
from patching_pairs import model_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_and_pairs():
    model = tiny_model("qwen3", initializer_range=0.2)  # 3 layers x 4 heads, 2 KV heads
    pairs = [model_pair(model, 24, fd, 2, seed=i, max_effect=True) for i, fd in enumerate((4, 11))]
    return model, pairs


@pytest.mark.filterwarnings("ignore")
def test_sender_scores_on_pairs(model_and_pairs):
    model, pairs = model_and_pairs
    R = [Head(1, 2), (2, 0)]
    fast = sender_scores(model, pairs, R, progress=False, min_clean_accuracy=0.0)
    plain = sender_scores(model, pairs, R, backend="naive", progress=False, min_clean_accuracy=0.0)
    assert fast.kind == "sender" and fast.per_sample_raw.shape == (2, 3, 4)
    assert fast.settings["receivers"] == [[1, 2], [2, 0]] and fast.settings["unreachable_from_layer"] == 2
    assert torch.all(fast.per_sample_raw[:, 2:] == 0) and torch.all(plain.per_sample_raw[:, 2:] == 0)
    assert (fast.per_sample_raw - plain.per_sample_raw).abs().max() <= 1e-5
    assert fast.per_sample_raw[:, :2].abs().max() > 1e-3
    recv = score(model, pairs, progress=False, min_clean_accuracy=0.0)
    assert torch.equal(fast.clean_metric, recv.clean_metric)  # same pairs, same normalization as score()
    one = sender_scores(model, pairs, (2, 0), progress=True, min_clean_accuracy=0.0)  # a single head; with a bar
    assert one.settings["receivers"] == [[2, 0]]


def test_sender_scores_by_task_name():
    model, tok = tiny_model("qwen3", initializer_range=0.2), char_tokenizer()
    kw = dict(tokenizer=tok, n_samples=2, seed=1, progress=False, min_clean_accuracy=0.0, context_length=160)
    a = sender_scores(model, "niah", [(1, 0), (2, 3)], **kw)
    b = sender_scores(model, "niah", [(1, 0), (2, 3)], **kw)
    assert a.task == "niah" and torch.equal(a.per_sample_raw, b.per_sample_raw)
    assert a.settings["task_config"] == {"context_length": 160}


def test_errors_name_the_problem(model_and_pairs):
    model, pairs = model_and_pairs
    with pytest.raises(ValueError, match="receivers is empty"):
        sender_scores(model, pairs, [], progress=False)
    with pytest.raises(ValueError, match=r"outside this model's 3 layers x 4 heads"):
        sender_scores(model, pairs, [(3, 0)], progress=False)
    with pytest.raises(ValueError, match="path patching supports"):
        sender_scores(model, pairs, [(1, 0)], backend="nnsight", progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        sender_scores(model, pairs, [(1, 0)], batch_size=0, progress=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        sender_scores(model, "niah", [(1, 0)], progress=False, context_length=160)
    with pytest.raises(ValueError, match="k=0"):
        iterated_path_patching(model, pairs, k=0, progress=False)
    with pytest.raises(ValueError, match="max_rounds"):
        iterated_path_patching(model, pairs, max_rounds=0, progress=False)
    with pytest.raises(ValueError, match="rule="):
        iterated_path_patching(model, pairs, rule="min", progress=False)


@pytest.mark.filterwarnings("ignore")
def test_iterated_rounds_follow_the_definition(model_and_pairs):
    model, pairs = model_and_pairs
    recv = score(model, pairs, progress=False, min_clean_accuracy=0.0)
    recv.per_sample_raw[:, 2, 1:3] = 1.0  # start from the last layer, so that there are rounds to iterate
    res = iterated_path_patching(model, pairs, receiver_scores=recv, k=2, max_rounds=4, progress=False,
                                 min_clean_accuracy=0.0)
    assert isinstance(res, PathPatchingResult) and res.receiver is recv
    assert res.rounds[0][0] == (Head(2, 1), Head(2, 2)) and len(res.rounds) >= 2
    for (heads, send), (nxt, _) in zip(res.rounds, res.rounds[1:]):  # next receivers = top-k senders (> 0)
        assert nxt == tuple(sorted(h for h in send.top(2) if send[h] > 0))
        assert torch.equal(send.per_sample_raw,
                           sender_scores(model, pairs, heads, progress=False, min_clean_accuracy=0.0).per_sample_raw)
    # 3 layers: each round's receivers lie in earlier layers, so it must have converged
    assert res.converged and len(res.rounds) <= 3
    sender = torch.stack([s.per_sample_raw for _, s in res.rounds]).amax(0)  # [N, L, H]
    assert torch.equal(res.sender.per_sample_raw, sender)
    assert torch.equal(res.combined.per_sample_raw, torch.maximum(recv.per_sample_raw, sender))
    assert res.combined.kind == "combined"
    df = res.to_dataframe()
    assert len(df) == 12 and {"receiver", "sender_round1", "sender", "combined", "rank", "receiver_round"} <= set(df)
    assert sorted(df.loc[df.receiver_round == 1, ["layer", "head"]].itertuples(index=False, name=None)) == \
        [(h.layer, h.head) for h in res.rounds[0][0]]
    once = iterated_path_patching(model, pairs, receiver_scores=recv, k=2, max_rounds=1, rule="mean",
                                  progress=False, min_clean_accuracy=0.0)
    assert len(once.rounds) == 1
    assert torch.allclose(once.combined.per_sample_raw,
                          combine(recv, once.rounds[0][1], rule="mean").per_sample_raw)


@pytest.mark.filterwarnings("ignore")
def test_iterated_computes_receiver_scores_and_default_k():
    model, tok = tiny_model("qwen3", initializer_range=0.2), char_tokenizer()
    res = iterated_path_patching(model, "niah", tokenizer=tok, n_samples=1, context_length=160, progress=False,
                                 min_clean_accuracy=0.0)
    assert default_k(12) == 1 and len(res.rounds[0][0]) == 1
    direct = score(model, "niah", tokenizer=tok, n_samples=1, context_length=160, progress=False,
                   min_clean_accuracy=0.0)
    assert torch.equal(res.receiver.per_sample_raw, direct.per_sample_raw)
    assert res.settings["k"] == 1 and res.combined.settings["path_patching"]["n_rounds"] == len(res.rounds)
