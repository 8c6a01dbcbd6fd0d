"""Patching backends by name: a new backend is one register_backend call; "auto" picks from the model."""
import pytest
import torch

from headscope.api import score
from headscope.patching import backends
from headscope.patching.backends import BACKENDS, PATH_BACKENDS, register_backend, register_path_backend
from headscope.patching.engine import NaiveBackend
from headscope.patching.path import NaivePathBackend
from headscope.senders import sender_scores

from model_factories import tiny_model
from patching_pairs import make_pair


class Marked(NaiveBackend):
    name = "marked"


@pytest.fixture
def registry():
    """The registries, left as they were after the test."""
    before = (BACKENDS.names(), PATH_BACKENDS.names())
    yield backends
    for reg, names in zip((BACKENDS, PATH_BACKENDS), before):
        for name in set(reg.names()) - set(names):
            reg.unregister(name)


def test_builtins_are_registered():
    assert {"hf", "naive", "transformer_lens", "nnsight"} <= set(BACKENDS) and {"hf", "naive"} <= set(PATH_BACKENDS)
    assert backends.resolve_backend(tiny_model("qwen3"), "auto") == "hf"


def test_a_new_backend_is_one_entry(registry):
    model = tiny_model("qwen3")
    pairs = [make_pair(16, 5, 2, 0)]
    registry.register_backend("marked", lambda m, hf, batch_size: Marked(hf), detect=lambda m: getattr(m, "mark", 0))
    s = score(model, pairs, backend="marked", progress=False, min_clean_accuracy=0.0)
    ref = score(model, pairs, backend="naive", progress=False, min_clean_accuracy=0.0)
    assert s.settings["backend"] == "marked" and torch.equal(s.per_sample_raw, ref.per_sample_raw)
    assert score(model, pairs, progress=False, min_clean_accuracy=0.0).settings["backend"] == "hf"
    model.mark = 1  # detect() claims it: "auto" picks the new backend
    assert score(model, pairs, progress=False, min_clean_accuracy=0.0).settings["backend"] == "marked"


def test_a_new_path_backend_is_one_entry(registry):
    model = tiny_model("qwen3")
    pairs = [make_pair(16, 5, 2, 0)]
    registry.register_path_backend("plain", lambda hf, receivers, batch_size: NaivePathBackend(hf, receivers))
    s = sender_scores(model, pairs, [(2, 0)], backend="plain", progress=False, min_clean_accuracy=0.0)
    ref = sender_scores(model, pairs, [(2, 0)], backend="naive", progress=False, min_clean_accuracy=0.0)
    assert s.settings["path_backend"] == "plain" and torch.equal(s.per_sample_raw, ref.per_sample_raw)


def test_bad_backends(registry):
    model, pairs = tiny_model("qwen3"), [make_pair(16, 5, 2, 0)]
    with pytest.raises(ValueError, match=r"backend='jax' is not one of \('auto', 'hf', 'naive'.*register_backend"):
        score(model, pairs, backend="jax", progress=False)
    with pytest.raises(ValueError, match=r"path patching supports \('hf', 'naive'\).*register_path_backend"):
        sender_scores(model, pairs, [(2, 0)], backend="nnsight", progress=False)
    with pytest.raises(ValueError, match="reserved"):
        register_backend("auto", lambda *a: None)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("hf", lambda *a: None)
    with pytest.raises(TypeError, match="callable"):
        register_backend("x", "not a factory")
    with pytest.raises(TypeError, match="detect"):
        register_backend("x", lambda *a: None, detect=3)
    with pytest.raises(ValueError, match="non-empty"):
        register_path_backend("", lambda *a: None)
    assert BACKENDS.names()[:4] == ("hf", "naive", "transformer_lens", "nnsight")  # nothing was added
    with pytest.raises(TypeError, match="TransformerBridge"):
        score(model, pairs, backend="transformer_lens", progress=False)
