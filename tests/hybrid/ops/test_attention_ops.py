"""attention op: SDPA against the eager twin in float64 (GQA, causal, q_offset), decode consistency, errors."""
import pytest
import torch

from hybrid.ops import attention, attention_eager

from testing_utils import assert_close


def qkv(B=2, T=9, S=9, H=4, K=2, D=8, Dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)  # [B, T, H, D]
    k = torch.randn(B, S, K, D, generator=gen, dtype=torch.float64)  # [B, S, K, D]
    v = torch.randn(B, S, K, Dv, generator=gen, dtype=torch.float64)  # [B, S, K, Dv]
    return q, k, v


@pytest.mark.parametrize("H,K", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_matches_eager(H, K, causal):
    q, k, v = qkv(H=H, K=K, Dv=5)
    o = attention(q, k, v, causal=causal, backend="sdpa", scale=0.2)
    assert o.shape == (2, 9, H, 5)
    assert_close("sdpa vs eager", o, attention(q, k, v, causal=causal, backend="eager", scale=0.2), "fp64_exact")
    assert_close("auto on cpu", attention(q, k, v, causal=causal, scale=0.2), o, "fp64_exact")


@pytest.mark.parametrize("T,S,q_offset", [(1, 12, 11), (3, 12, 9), (4, 12, 5), (5, 8, 0)])
def test_q_offset_matches_eager(T, S, q_offset):
    q, k, v = qkv(T=T, S=S)
    o = attention(q, k, v, backend="sdpa", q_offset=q_offset)
    assert_close("sdpa vs eager", o, attention_eager(q, k, v, q_offset=q_offset), "fp64_exact")


def test_decode_rows_equal_full_sequence_rows():
    """Query i at key position q_offset + i sees exactly what row q_offset + i of the full causal pass sees."""
    q, k, v = qkv(T=12, S=12, H=4, K=2)
    full = attention(q, k, v, backend="sdpa")  # [B, T, H, Dv]
    for start, end in ((11, 12), (7, 10)):  # one-token decode, and a 3-token chunk after a cache
        part = attention(q[:, start:end], k[:, :end], v[:, :end], backend="sdpa", q_offset=start)
        assert_close(f"rows {start}:{end}", part, full[:, start:end], "fp64_exact")


def test_eager_is_softmax_definition():
    q, k, v = qkv(B=1, T=3, S=3, H=1, K=1, D=2, Dv=2)
    scores = torch.einsum("td,sd->ts", q[0, :, 0], k[0, :, 0]) * 2 ** -0.5  # [T, S]
    scores = scores.masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
    ref = scores.softmax(-1) @ v[0, :, 0]  # [T, Dv]
    assert_close("eager", attention_eager(q, k, v)[0, :, 0], ref, "fp64_exact")


def test_errors_name_the_problem():
    q, k, v = qkv(H=3, K=2)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q, k, v)
    q, k, v = qkv(T=4, S=6)
    with pytest.raises(ValueError, match="needs at least q_offset"):
        attention(q, k, v, q_offset=3)
    with pytest.raises(ValueError, match="backend must be one of"):
        attention(q, k, v, backend="xformers")
    with pytest.raises(ValueError, match="q_offset must be"):
        attention(q, k, v, q_offset=-1)
    with pytest.raises(ValueError, match=r"\[B, S, K, D\]"):
        attention(q, k[..., :3], v)


def test_sdpa_repeats_kv_heads_where_enable_gqa_would_fall_back_to_math():
    """CUDA's memory-efficient backend rejects enable_gqa: float32 (or a mask) gets the heads repeated instead of
    the math backend's [B, H, T, S] float32 scores; flash dtypes without a mask keep enable_gqa."""
    from hybrid.ops.attention import sdpa_expands_kv

    assert sdpa_expands_kv(True, torch.float32, False)
    assert sdpa_expands_kv(True, torch.bfloat16, True)
    assert not sdpa_expands_kv(True, torch.bfloat16, False)
    assert not sdpa_expands_kv(True, torch.float16, False)
    assert not sdpa_expands_kv(False, torch.float32, False)  # the CPU: the same kernel either way
    assert sdpa_expands_kv(False, torch.float32, True)


@pytest.mark.gpu
def test_sdpa_float32_gqa_memory_is_linear_in_length_on_cuda():
    """A float32 GQA pass at 8K tokens stays far below the math backend's scores (9 x 8192^2 x 4 B = 2.4 GB)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8192, 9, 64, device="cuda", generator=gen)  # [B, T, H, D]
    k = torch.randn(1, 8192, 3, 64, device="cuda", generator=gen)  # [B, S, K, D]
    v = torch.randn(1, 8192, 3, 64, device="cuda", generator=gen)  # [B, S, K, D]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = attention(q, k, v, backend="sdpa")  # [B, T, H, D]
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 256 * 2**20
    ref = attention(q[:, -64:].double(), k.double(), v.double(), backend="eager", q_offset=8192 - 64)  # [B, 64, H, D]
    assert_close("last rows vs eager", o[:, -64:].double(), ref, "fp32")
