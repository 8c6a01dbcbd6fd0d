"""The fast HF path (prefix reuse, layer skip, heads as batch elements) equals the naive loop exactly."""
import pytest
import torch

from headscope.metrics import resolve_metric
from headscope.patching import HFBackend, HFFastConfig, NaiveBackend, as_patch_pair, receiver_scores

from model_factories import tiny_model
from patching_pairs import make_pair, model_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def sharp_model(family, **kw):
    """A tiny model with larger weights than the default init: realistic logit gaps, so the normalization
    denominator M_clean - M_corrupt is not ~0 (which would magnify float32 rounding)."""
    return tiny_model(family, initializer_range=0.2, **kw)


FAMILIES = ["qwen3", "llama", "qwen2", "mistral", "gpt2", "gpt_neox"]


def scores(backend, pairs, metric="logit_diff"):
    return receiver_scores(backend, pairs, resolve_metric(metric), progress=False,
                           on_clean_failure="warn", min_clean_accuracy=0.0).per_sample_raw  # [N, L, H]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fast_equals_naive(family, impl):
    model = sharp_model(family, attn_implementation=impl)
    T = 24
    # first_diff at 0, in the middle and right before the answer; 1-, 3- and 2-token answers
    pairs = [as_patch_pair(model_pair(model, T, fd, n_ans, seed=i, max_effect=True)) for i, (fd, n_ans) in
             enumerate([(0, 1), (11, 3), (T - 2, 2)])]
    assert [p.first_diff for p in pairs] == [0, 11, T - 2]
    ref = scores(NaiveBackend(model), pairs)
    for batch_size in (None, 5, 12):  # None: one layer per forward; 5: batches straddle layers; 12: all
        fast = scores(HFBackend(model, HFFastConfig(batch_size=batch_size)), pairs)
        assert (fast - ref).abs().max() <= 1e-5, (family, impl, batch_size)
    assert ref.abs().max() > 0  # patching actually changed something


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_fast_equals_naive_float64(family):
    model = sharp_model(family, attn_implementation="sdpa", dtype=torch.float64)
    pairs = [as_patch_pair(make_pair(20, 7, 2, seed=3))]
    ref = scores(NaiveBackend(model), pairs, "logprob")
    fast = scores(HFBackend(model, HFFastConfig(batch_size=3)), pairs, "logprob")
    assert (fast - ref).abs().max() <= 1e-10


def test_fast_path_restores_model():
    model = tiny_model("qwen3")
    ids = torch.randint(0, 128, (1, 16))
    before = model(ids).logits
    HFBackend(model, HFFastConfig(batch_size=4)).patched_metrics(as_patch_pair(make_pair(16, 5, 2, 0)),
                                                                 resolve_metric("logit_diff"))
    for layer in model.model.layers:
        assert "forward" not in layer.__dict__  # replays removed
        assert not layer._forward_hooks and not layer.self_attn.o_proj._forward_pre_hooks
    assert torch.equal(model(ids).logits, before)


def test_oom_halves_batch(monkeypatch):
    model = tiny_model("qwen3")
    pair = as_patch_pair(make_pair(16, 5, 2, 0))
    metric = resolve_metric("logit_diff")
    ref = NaiveBackend(model).patched_metrics(pair, metric)
    backend = HFBackend(model, HFFastConfig(batch_size=12))  # all heads in one forward, then halved on OOM
    real = backend._run_batch
    sizes = []

    def flaky(jobs, *args):
        sizes.append(len(jobs))
        if len(jobs) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(jobs, *args)

    monkeypatch.setattr(backend, "_run_batch", flaky)
    out = backend.patched_metrics(pair, metric)
    assert sizes[0] == 12 and max(sizes[sizes.index(3):]) <= 3  # halved 12 -> 6 -> 3, then kept
    assert (out - ref).abs().max() <= 1e-5
