"""headscope.evaluate.attention: float32 GQA prompts repeat their key/value heads before SDPA (so CUDA's
memory-efficient backend runs, not the math one); the same outputs, and the original function back afterwards."""
import pytest
import torch

from headscope.evaluate.attention import float32_sdpa_repeats_kv, repeats_kv
from headscope.synthetic import random_qwen3

SHAPE = dict(layers=2, heads=4, kv_heads=2, head_dim=16, hidden=32, intermediate=64, vocab=97)


def _spy(monkeypatch):
    """Record (key heads, enable_gqa) of every SDPA call."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((k.shape[1], bool(kwargs.get("enable_gqa", False))))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_repeats_kv_only_for_float32_cuda_prompts():
    cpu = torch.zeros(1, 4, 8, 16)  # [B, H, T, D]
    assert not repeats_kv(cpu, 2)  # the CPU: unchanged
    meta = torch.zeros(1, 4, 8, 16, device="meta")
    assert not repeats_kv(meta, 2)
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        assert repeats_kv(torch.zeros(1, 4, 8, 16, device="cuda"), 2)
        assert not repeats_kv(torch.zeros(1, 4, 8, 16, device="cuda", dtype=torch.bfloat16), 2)
        assert not repeats_kv(torch.zeros(1, 4, 1, 16, device="cuda"), 2)  # decoding
        assert not repeats_kv(torch.zeros(1, 4, 8, 16, device="cuda"), 1)  # no groups


def test_repeated_heads_give_the_same_logits_and_the_function_comes_back(monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = random_qwen3(SHAPE, seed=1)
    ids = torch.randint(0, SHAPE["vocab"], (2, 12), generator=torch.Generator().manual_seed(0))  # [B, T]
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    calls = _spy(monkeypatch)
    with torch.no_grad():
        plain = model(ids).logits  # [B, T, V]
        assert calls and all(c == (SHAPE["kv_heads"], True) for c in calls)  # GQA passed to SDPA as is
        calls.clear()
        with float32_sdpa_repeats_kv(applies=lambda q, groups: groups > 1 and q.shape[2] > 1):
            repeated = model(ids).logits  # [B, T, V]
        assert len(calls) == SHAPE["layers"] and all(c == (SHAPE["heads"], False) for c in calls)
    torch.testing.assert_close(repeated, plain, rtol=1e-5, atol=1e-5)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


def test_the_default_changes_nothing_on_the_cpu_and_restores_after_an_error(monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = random_qwen3(SHAPE, seed=2)
    ids = torch.randint(0, SHAPE["vocab"], (1, 9), generator=torch.Generator().manual_seed(1))  # [B, T]
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    calls = _spy(monkeypatch)
    with pytest.raises(RuntimeError, match="inside"):
        with float32_sdpa_repeats_kv():
            with float32_sdpa_repeats_kv():  # nested: installed once
                assert ALL_ATTENTION_FUNCTIONS["sdpa"].wrapped is before
                with torch.no_grad():
                    model(ids)
            raise RuntimeError("inside")
    assert all(c == (SHAPE["kv_heads"], True) for c in calls)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float32_gqa_runs_on_the_memory_efficient_backend_on_cuda():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = random_qwen3(SHAPE, seed=3, device="cuda")
    ids = torch.randint(0, SHAPE["vocab"], (2, 300), device="cuda")  # [B, T]
    with torch.no_grad():
        plain = model(ids).logits  # [B, T, V] (math backend)
        with float32_sdpa_repeats_kv(), sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # refuses math
            tiled = model(ids).logits  # [B, T, V]
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), pytest.raises(RuntimeError):
            model(ids)  # without the repeat, no efficient kernel takes float32 GQA
    torch.testing.assert_close(tiled, plain, rtol=1e-4, atol=1e-4)
