"""Fast path patching (HFPathBackend) equals the plain definition (NaivePathBackend) on tiny models."""
import pytest
import torch

from headscope.hooks import hooks, pre
from headscope.metrics import resolve_metric
from headscope.patching import HFFastConfig, as_patch_pair, receiver_scores
from headscope.patching.path import HFPathBackend, NaivePathBackend

from model_factories import tiny_model
from patching_pairs import make_pair, model_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def four_layers(family: str, **kw):
    """A 4-layer tiny model (4 query heads; 2 KV heads for the GQA families), weights large enough for clear
    logit gaps (see test_patching_exact.sharp_model)."""
    layers = dict(n_layer=4) if family == "gpt2" else dict(num_hidden_layers=4, layer_types=["full_attention"] * 4)
    return tiny_model(family, initializer_range=0.2, **layers, **kw)


def normalized(backend, pairs, metric="logit_diff"):
    return receiver_scores(backend, pairs, resolve_metric(metric), progress=False, on_clean_failure="warn",
                           min_clean_accuracy=0.0).per_sample_raw  # [N, L, H]


RECEIVER_SETS = {
    "one layer": [(2, 1)],
    "spread": [(1, 0), (3, 2)],  # (1, 0) is a receiver and a sender to (3, 2)
    "gqa siblings": [(1, 3), (2, 0), (2, 1), (3, 1)],  # (2, 0) and (2, 1) share a KV head
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", ["qwen3", "llama", "gpt2"])
def test_fast_equals_plain(family):
    model = four_layers(family, attn_implementation="sdpa")
    T = 24
    pairs = [as_patch_pair(model_pair(model, T, fd, n_ans, seed=i, max_effect=True)) for i, (fd, n_ans) in
             enumerate([(0, 1), (9, 2), (T - 2, 2)])]  # first_diff at 0, mid-prompt, right before the answer
    assert [p.first_diff for p in pairs] == [0, 9, T - 2]
    for name, R in RECEIVER_SETS.items():
        last = max(l for l, _ in R)
        ref = normalized(NaivePathBackend(model, R), pairs)
        ref[:, last:] = 0.0  # the plain loop skips them too (see test_unreachable_senders_are_zero)
        variants = [dict(), dict(config=HFFastConfig(batch_size=3), slim=False)]  # 3: batches straddle layers
        for kw in variants:
            fast = normalized(HFPathBackend(model, R, **kw), pairs)
            assert (fast - ref).abs().max() <= 1e-5, (family, name, kw)
        assert ref[:, :last].abs().max() > 1e-3, (family, name)  # the senders do move the metric


@pytest.mark.filterwarnings("ignore")
def test_fast_equals_plain_eager_and_float64():
    model = four_layers("qwen2")  # eager attention, q/k/v biases
    pairs = [as_patch_pair(model_pair(model, 20, 6, 2, seed=5, max_effect=True))]
    R = RECEIVER_SETS["gqa siblings"]
    assert (normalized(HFPathBackend(model, R), pairs) - normalized(NaivePathBackend(model, R), pairs))[:, :3] \
        .abs().max() <= 1e-5
    model64 = four_layers("qwen3", attn_implementation="sdpa", dtype=torch.float64)
    pairs = [as_patch_pair(make_pair(20, 7, 2, seed=3))]
    ref = normalized(NaivePathBackend(model64, R), pairs, "logprob")
    fast = normalized(HFPathBackend(model64, R, HFFastConfig(batch_size=5)), pairs, "logprob")
    assert (fast - ref)[:, :3].abs().max() <= 1e-10


@pytest.mark.filterwarnings("ignore")
def test_unreachable_senders_are_zero():
    """Senders at layers >= the last receiver layer: ~0 when computed literally, exactly 0 (not computed) fast."""
    model = four_layers("qwen3")
    pairs = [as_patch_pair(model_pair(model, 20, 5, 2, seed=1, max_effect=True))]
    R = [(1, 2), (2, 0)]
    literal = normalized(NaivePathBackend(model, R, skip_unreachable=False), pairs)  # [1, 4, 4]
    assert literal[:, 2:].abs().max() <= 1e-5 and literal[:, :2].abs().max() > 1e-3
    backend = HFPathBackend(model, R)
    calls = []
    real = backend._run_batch
    backend._run_batch = lambda jobs, **kw: calls.append(list(jobs)) or real(jobs, **kw)
    m = backend.patched_metrics(pairs[0], resolve_metric("logit_diff"))  # [L, H] metric values
    assert all(l < 2 for jobs in calls for l, _ in jobs)  # layers 2, 3 never run
    m_clean = float(resolve_metric("logit_diff")(backend.answer_logits(pairs[0].clean_ids, pairs[0].answer_pos),
                                                 pairs[0])[0])
    assert torch.all(m[2:] == m_clean)


def test_fast_path_restores_model():
    model = four_layers("qwen3")
    ids = torch.randint(0, 128, (1, 16))
    before = model(ids).logits
    pair = as_patch_pair(make_pair(16, 5, 2, 0))
    HFPathBackend(model, [(1, 1), (3, 0)], HFFastConfig(batch_size=4)).patched_metrics(pair, resolve_metric("logprob"))

    backend = HFPathBackend(model, [(2, 1), (3, 0)])
    slim = backend.slim[2]
    slim.z = lambda *a: (_ for _ in ()).throw(ValueError("inside the sender run"))
    with pytest.raises(ValueError, match="inside the sender run"):
        backend.patched_metrics(pair, resolve_metric("logprob"))
    calls = []

    def fail_third(module, args):  # final norm: clean run, corrupted run, then the first receiver run
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("inside the receiver run")

    with hooks(pre(model.model.norm, fail_third)), pytest.raises(ValueError, match="inside the receiver run"):
        HFPathBackend(model, [(2, 1), (3, 0)]).patched_metrics(pair, resolve_metric("logprob"))
    for layer in model.model.layers:
        assert "forward" not in layer.__dict__ and "forward" not in layer.self_attn.__dict__
        assert not layer._forward_hooks and not layer.self_attn._forward_hooks
        assert not layer.self_attn.o_proj._forward_pre_hooks and not layer.self_attn._forward_pre_hooks
    assert torch.equal(model(ids).logits, before)
