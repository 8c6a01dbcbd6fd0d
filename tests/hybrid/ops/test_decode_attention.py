"""Decode attention (one query per row, per-row lengths, GQA, optional window): the SDPA twin vs the eager
attention per row (float64); the split-KV Triton kernel vs the twin in Triton's CPU interpreter (when Triton
imports) and on the GPU in bf16 (marked gpu)."""
import textwrap

import pytest
import torch

from hybrid.ops import attention_eager
from hybrid.ops.decode_attention import decode_attention, decode_attention_reference, resolve_backend
from hybrid.ops.prologue import triton_available

from testing_utils import assert_close, compile_for_hopper, run_in_triton_interpreter


@pytest.mark.parametrize("H,K,window", [(4, 2, None), (6, 1, None), (4, 4, 3), (8, 2, 40)])
def test_reference_equals_eager_attention_per_row(H, K, window):
    torch.manual_seed(H + K)
    B, S, D = 3, 90, 8
    q = torch.randn(B, 1, H, D, dtype=torch.float64)
    k, v = torch.randn(B, S, K, D, dtype=torch.float64), torch.randn(B, S, K, D, dtype=torch.float64)
    lens = [1, 47, 90]
    got = decode_attention(q, k, v, torch.tensor(lens), scale=0.4, window=window)  # CPU: the twin
    for b, n in enumerate(lens):
        lo = 0 if window is None else max(0, n - window)
        ref = attention_eager(q[b:b + 1], k[b:b + 1, lo:n], v[b:b + 1, lo:n], causal=True, scale=0.4,
                              q_offset=n - lo - 1)
        assert_close(f"row {b}", got[b:b + 1], ref, "fp64_exact")


def test_decode_attention_errors():
    q, k = torch.randn(2, 1, 4, 8), torch.randn(2, 10, 2, 8)
    with pytest.raises(ValueError, match=r"\[B, 1, H, D\]"):
        decode_attention(torch.randn(2, 2, 4, 8), k, k, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention(torch.randn(2, 1, 3, 8), k, k, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="kv_len must be"):
        decode_attention(q, k, k, torch.tensor([1]))
    with pytest.raises(ValueError, match="backend must be one of"):
        decode_attention(q, k, k, torch.tensor([1, 2]), backend="flash")
    assert resolve_backend("auto", q) == "torch"


INTERPRETED = textwrap.dedent("""
    import torch
    from hybrid.ops.decode_attention import decode_attention_reference, decode_attention_triton
    from testing_utils import assert_close, compile_for_hopper, run_in_triton_interpreter
    torch.manual_seed(0)
    for B, H, K, D, S, lens, window in [(2, 4, 2, 16, 300, [1, 300], None), (3, 16, 8, 32, 257, [5, 100, 257], None),
                                        (2, 2, 1, 64, 200, [130, 7], 50)]:
        q, k, v = torch.randn(B, 1, H, D), torch.randn(B, S, K, D), torch.randn(B, S, K, D)
        kl = torch.tensor(lens)
        assert_close(f"H={H} K={K} window={window}", decode_attention_triton(q, k, v, kl, 0.3, window),
                     decode_attention_reference(q, k, v, kl, 0.3, window), "fp32")
    # the tunings research/perf/decode_attention_sweep.py times give the same function
    for tuning in [dict(block_n=16, waves=1), dict(block_n=32, waves=4), dict(block_n=128, waves=8, num_warps=8,
                                                                              num_stages=2)]:
        assert_close(f"window={window} {tuning}", decode_attention_triton(q, k, v, kl, 0.3, window, **tuning),
                     decode_attention_reference(q, k, v, kl, 0.3, window), "fp32")
    print("OK")
""")


@pytest.mark.skipif(not triton_available(), reason="Triton not importable (the GPU image has it)")
def test_split_kv_kernel_in_cpu_interpreter_matches_reference():
    run_in_triton_interpreter(INTERPRETED)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,K,window", [(16, 8, None), (2, 1, None), (16, 16, 512)])
def test_split_kv_kernel_bf16_matches_float32_reference(D, H, K, window):
    from hybrid.ops.decode_attention import decode_attention_triton

    torch.manual_seed(D + H)
    B, S = 3, 20000
    q = torch.randn(B, 1, H, D, device="cuda").bfloat16()
    k, v = torch.randn(B, S, K, D, device="cuda").bfloat16(), torch.randn(B, S, K, D, device="cuda").bfloat16()
    kl = torch.tensor([1, 777, S], device="cuda")
    ref = decode_attention_reference(q.float(), k.float(), v.float(), kl, None, window)
    err = assert_close(f"D={D} H={H} K={K}", decode_attention_triton(q, k, v, kl, None, window), ref, "bf16_kernel")
    print(f"decode attention D={D} H={H} K={K} window={window}: {err:.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
def test_split_kv_kernel_offsets_past_2_31_elements():
    """17 rows x 128K keys x 8 KV heads x 128 = 2.3e9 elements per buffer: row offsets must be int64 (the
    whole-model benchmark's largest-batch search hit an illegal memory access here with int32 offsets)."""
    from hybrid.ops.decode_attention import decode_attention_triton

    B, S, K, H, D = 17, 131072, 8, 16, 128
    assert B * S * K * D > 2 ** 31
    torch.manual_seed(0)
    k = torch.empty(B, S, K, D, device="cuda", dtype=torch.bfloat16).normal_()  # [B, S, K, D] 4.6 GB
    v = torch.empty_like(k).normal_()  # [B, S, K, D]
    q = torch.randn(B, 1, H, D, device="cuda").bfloat16()  # [B, 1, H, D]
    kl = torch.full((B,), S, device="cuda")  # [B]
    got = decode_attention_triton(q, k, v, kl)  # [B, 1, H, D]
    for b in (0, B - 1):  # the first row and the last (past 2**31)
        ref = decode_attention_reference(q[b:b + 1].float(), k[b:b + 1].float(), v[b:b + 1].float(), kl[b:b + 1])
        assert_close(f"row {b}", got[b:b + 1], ref, "bf16_kernel")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
def test_split_kv_with_programmatic_dependent_launch_gives_the_same_output():
    """Inside dependent_launch() (Hopper: both kernels launched with PDL, each waiting for the kernel before it)
    the output is bitwise the one without, eagerly and replayed from a CUDA graph right after a kernel that writes q."""
    from hybrid.ops.decode_attention import decode_attention_triton
    from hybrid.ops.utils import dependent_launch, pdl_launch

    torch.manual_seed(0)
    B, S, K, H, D = 2, 40000, 1, 2, 128
    q0 = torch.randn(B, 1, H, D, device="cuda").bfloat16()  # [B, 1, H, D]
    k, v = torch.randn(B, S, K, D, device="cuda").bfloat16(), torch.randn(B, S, K, D, device="cuda").bfloat16()
    kl = torch.tensor([S, 1234], device="cuda")  # [B]
    want = decode_attention_triton(q0, k, v, kl)
    with dependent_launch():
        assert pdl_launch(q0) == (torch.cuda.get_device_capability()[0] >= 9)
        q = q0 * 1.0  # a kernel right before, whose output the split kernel reads
        got = decode_attention_triton(q, k, v, kl)
        q_static = torch.zeros_like(q0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = decode_attention_triton(q_static * 1.0, k, v, kl)
    q_static.copy_(q0)
    graph.replay()
    assert torch.equal(got, want) and torch.equal(replayed, want)


@pytest.mark.skipif(not triton_available(), reason="Triton not importable (the GPU image has it)")
@pytest.mark.parametrize("gdc", [False, True])
def test_split_kv_and_combine_compile_for_hopper_with_and_without_dependent_launch(gdc):
    """Compiled ahead of time for sm_90 (no GPU needed): with USE_GDC each kernel waits once for the kernel before
    it and lets the next one launch once; without, neither instruction is there."""
    import importlib

    _, split_kv, combine = importlib.import_module("hybrid.ops.decode_attention")._kernel()
    ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "len_ptr": "*i64", "o_ptr": "*fp32",
            "m_ptr": "*fp32", "l_ptr": "*fp32", "scale": "fp32"}
    ptx = compile_for_hopper(split_kv, ptrs, {"K": 1, "REP": 2, "RP": 16, "D": 128, "BN": 64, "WINDOWED": False,
                                              "USE_GDC": gdc}, launch_pdl=gdc)
    assert (ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")) == (gdc, gdc)
    ptx = compile_for_hopper(combine, {"o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "out_ptr": "*bf16"},
                             {"NS": 64, "D": 128, "USE_GDC": gdc}, launch_pdl=gdc)
    assert (ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")) == (gdc, gdc)
