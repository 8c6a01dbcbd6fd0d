"""The token-level baseline's sliding window: the chunked kernel (no [T, S] mask) equals the dense-mask twin."""
import pytest
import torch

import hybrid.layers.common as common
import hybrid.layers.hybrid_attention as hybrid_attention
from hybrid.builders import from_token_level
from hybrid.layers.common import window_attention, window_attention_dense

from model_factories import tiny_model
from testing_utils import assert_close


@pytest.mark.parametrize("window", [1, 5, 256, 300, 700])
@pytest.mark.parametrize("T,S,q_offset,k_offset", [(700, 700, 0, 0), (600, 700, 100, 0), (3, 40, 37, 0),
                                                   (1, 20, 519, 500), (530, 540, 510, 500)])
def test_chunked_window_attention_equals_dense(window, T, S, q_offset, k_offset):
    torch.manual_seed(T + window)
    q = torch.randn(2, T, 3, 8, dtype=torch.float64)
    k, v = torch.randn(2, S, 3, 8, dtype=torch.float64), torch.randn(2, S, 3, 8, dtype=torch.float64)
    got = window_attention(q, k, v, window, q_offset, k_offset, 0.3)
    ref = window_attention_dense(q, k, v, window, q_offset, k_offset, 0.3)
    assert_close(f"window={window}", got, ref, "fp64_exact")


def test_never_builds_a_full_mask(monkeypatch):
    """At T = 2048 with window 16 every SDPA call sees at most C + window - 1 keys."""
    seen = []
    real = common.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[-2], k.shape[-2]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(common.F, "scaled_dot_product_attention", spy)
    q = torch.randn(1, 2048, 2, 8)
    window_attention(q, q, q, 16, 0, 0, 0.3)
    C = max(16, common.WINDOW_CHUNK_MIN)
    assert seen and max(s for _, s in seen) <= C + 15 and max(t for t, _ in seen) <= C


def test_token_level_model_unchanged(monkeypatch):
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = from_token_level(teacher, window=7)
    ids = torch.randint(0, 128, (1, 300))
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
        monkeypatch.setattr(hybrid_attention, "window_attention", window_attention_dense)
        ref = model(ids, use_cache=False).logits
    assert_close("token-level logits", got, ref, "fp64_exact")
