"""hybrid.ops.gemv: the decode projections' GEMV. Its twin is F.linear; the backend rules and errors; the custom op
(opcheck, one graph under torch.compile on the CUDA path's dispatch, checked on the CPU); a model switched with
use_decode_gemv gives the same decode logits and still runs a Linear's hooks; the Triton kernel against the twin in
Triton's CPU interpreter and compiled for sm_90 with and without PDL (where Triton imports); on the GPU in bf16
(marked gpu)."""
import textwrap

import pytest
import torch
import torch.nn.functional as F

import hybrid.ops.gemv as gv
from headscope.mask import HeadMask
from hybrid.convert import from_mask
from hybrid.decoding import Decoder, prefill
from hybrid.layers.common import use_decode_gemv
from hybrid.ops.prologue import triton_available
from hybrid.ops.utils import custom_ops_on_cpu
from research.perf.op_count import custom_ops_in

from model_factories import tiny_model
from testing_utils import assert_close, compile_for_hopper, run_in_triton_interpreter

pytestmark = pytest.mark.usefixtures("one_thread")
FA = [(0, 1), (0, 2), (1, 0), (1, 3), (2, 2)]  # as tests/hybrid/test_decoding.py


def args(M=3, N=20, K=32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 1, K, generator=g)  # [M, 1, K]
    w = torch.randn(N, K, generator=g)  # [N, K]
    return x, w, torch.randn(N, generator=g) if bias else None


def test_the_cpu_default_is_f_linear_and_bad_input_is_named():
    x, w, b = args()
    assert torch.equal(gv.decode_linear(x, w, b), F.linear(x, w, b))
    assert gv.resolve_backend("auto", x, w) == "torch"  # not the CUDA path
    with pytest.raises(ValueError, match="share K"):
        gv.decode_linear(x, w[:, :8])
    with pytest.raises(ValueError, match=r"bias must be \[N\] = \[20\]"):
        gv.decode_linear(x, w, b[:3])
    with pytest.raises(ValueError, match="backend must be one of"):
        gv.decode_linear(x, w, backend="cublas")


def test_the_cuda_paths_rules_on_the_cpu():
    """Inside custom_ops_on_cpu() the CUDA path's dispatch runs: "auto" picks the kernel for decode rows only
    (at most MAX_ROWS, one dtype, K a multiple of 8, no gradient); asking for it otherwise names the fix."""
    x, w, _ = args()
    with custom_ops_on_cpu():
        assert gv.resolve_backend("auto", x, w) == "triton"
        many = torch.randn(gv.MAX_ROWS + 1, 32)  # [9, K]: a prefill's rows
        assert gv.resolve_backend("auto", many, w) == "torch"
        assert gv.resolve_backend("auto", x, w, needs_grad=True) == "torch"
        assert gv.resolve_backend("auto", x.double(), w.double()) == "torch"
        assert gv.resolve_backend("auto", torch.randn(1, 12), torch.randn(4, 12)) == "torch"  # K = 12
        with pytest.raises(ValueError, match="at most 8 rows"):
            gv.resolve_backend("triton", many, w)
        with pytest.raises(ValueError, match="no backward"):
            gv.resolve_backend("triton", x, w, needs_grad=True)


def test_opcheck_and_the_op_equals_its_twin():
    for a in (args(), args(M=1, N=7, K=16, bias=False, seed=1)):
        torch.library.opcheck(torch.ops.hybrid.decode_linear.default, a)
        got = torch.ops.hybrid.decode_linear(*a)
        assert got.is_contiguous() and torch.equal(got, F.linear(*a))


def test_compiled_on_the_cuda_paths_dispatch_it_is_one_op_in_one_graph():
    import torch._dynamo as dynamo

    x, w, b = args()
    with custom_ops_on_cpu():
        dynamo.reset()
        explained = dynamo.explain(gv.decode_linear)(x, w, b)
        assert explained.graph_break_count == 0
        assert custom_ops_in(explained.graphs) == {"hybrid::decode_linear": 1}
        assert torch.equal(torch.compile(gv.decode_linear, backend="aot_eager")(x, w, b), F.linear(x, w, b))
    dynamo.reset()


def hybrid_model():
    torch.manual_seed(0)
    teacher = tiny_model("qwen3", head_dim=16).float()
    return from_mask(teacher, HeadMask.for_model(teacher, FA)).eval()


def decode_logits(model, steps=3, during_steps=lambda: None):
    """Logits [steps, B, V] of greedy decode steps after a prefill of two prompts; ``during_steps()`` is called
    after the prefill (to count the steps' calls alone)."""
    torch.manual_seed(1)
    prompts = [torch.randint(0, 128, (n,)) for n in (9, 5)]
    cache, logits = prefill(model, prompts, steps + 2)
    dec = Decoder(model, cache)
    during_steps()
    ids, outs = logits.argmax(-1, keepdim=True), []  # [B, 1]
    for _ in range(steps):
        out = dec.step(ids)  # [B, V]
        outs.append(out)
        ids = out.argmax(-1, keepdim=True)
    return torch.stack(outs)  # [steps, B, V]


def test_use_decode_gemv_routes_every_projection_and_keeps_the_logits_and_the_hooks():
    """On the CUDA path's dispatch (custom_ops_on_cpu, the op's CPU kernel being F.linear) the decode steps call
    the op for the decode input projections, o_proj, the MLP's three and the output head, and give the same logits
    as without; a Linear with a hook takes its own call (the hook runs); off again, no op is called."""
    from collections import Counter

    model = hybrid_model()
    want = decode_logits(model)
    assert use_decode_gemv(model) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    calls = Counter()
    real = gv.decode_linear_reference

    def counted(x, w, b=None):
        calls[w.data_ptr()] += 1
        return real(x, w, b)

    gv.decode_linear_reference = counted  # the op's CPU kernel (the twin), counted
    try:
        with custom_ops_on_cpu():
            got = decode_logits(model, during_steps=calls.clear)
    finally:
        gv.decode_linear_reference = real
    assert_close("logits with the decode GEMV", got, want, "fp32")
    # every step: each layer's o_proj and MLP projections and the output head, by their own weights; the decode
    # input projections by their fused copies (other weights), at least one a layer
    own = [model.lm_head] + [lin for layer in model.model.layers for lin in (
        layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    assert all(calls[lin.weight.data_ptr()] == 3 for lin in own)
    assert sum(calls.values()) - 3 * len(own) >= 3 * len(model.model.layers)
    seen = []
    h = model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, i, o: seen.append(1))
    try:
        with custom_ops_on_cpu():
            decode_logits(model, steps=1)
    finally:
        h.remove()
    assert seen  # the hooked o_proj ran as a Linear
    use_decode_gemv(model, False)
    assert not any(getattr(m, "decode_gemv", False) for m in model.modules())


INTERPRETED = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from hybrid.ops.gemv import decode_linear_triton, MAX_ROWS
    from testing_utils import assert_close
    torch.manual_seed(0)
    for M, N, K, bias in [(1, 40, 64, False), (3, 17, 520, True), (MAX_ROWS, 100, 256, True), (1, 1, 8, False),
                          (5, 33, 1000, False)]:
        x, w = torch.randn(M, 1, K), torch.randn(N, K) * 0.1  # [M, 1, K], [N, K]
        b = torch.randn(N) if bias else None
        got = decode_linear_triton(x, w, b)
        assert got.shape == (M, 1, N) and got.dtype == x.dtype
        assert_close(f"gemv M={M} N={N} K={K}", got, F.linear(x, w, b), "fp32")
    xs = torch.randn(2, 64)[:, ::2]  # [2, 32] a strided x
    assert_close("strided x", decode_linear_triton(xs, torch.ones(3, 32)), F.linear(xs, torch.ones(3, 32)), "fp32")
    print("OK")
""")


@pytest.mark.skipif(not triton_available(), reason="Triton not importable (the GPU image has it)")
def test_triton_kernel_in_cpu_interpreter_matches_the_twin():
    run_in_triton_interpreter(INTERPRETED)


@pytest.mark.skipif(not triton_available(), reason="Triton not importable (the GPU image has it)")
@pytest.mark.parametrize("gdc", [False, True])
def test_kernel_compiles_for_hopper_with_and_without_dependent_launch(gdc):
    _, gemv = gv._kernel()
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16"}
    ptx = compile_for_hopper(gemv, types, {"HAS_BIAS": False, "BN": gv.BLOCK_N, "BK": gv.BLOCK_K, "IEEE": False,
                                           "USE_GDC": gdc}, launch_pdl=gdc)
    assert (ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")) == (gdc, gdc)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
@pytest.mark.parametrize("M,N,K", [(1, 2048, 2048), (1, 6144, 2048), (1, 2048, 6144), (8, 6172, 2048),
                                   (3, 1000, 520)])
def test_gpu_bf16_kernel_matches_f_linear_in_float32(M, N, K):
    """bf16: the kernel vs F.linear on the same inputs in float32 (bf16_kernel: the kernel sums in float32 and
    rounds once); with a bias; and the same output with programmatic dependent launch."""
    from hybrid.ops.utils import dependent_launch

    torch.manual_seed(M + N)
    x = torch.randn(M, 1, K, device="cuda", dtype=torch.bfloat16)  # [M, 1, K]
    w = (torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)  # [N, K]
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    got = gv.decode_linear_triton(x, w, b)
    assert_close(f"gemv bf16 M={M} N={N} K={K}", got.float(), F.linear(x.float(), w.float(), b.float()),
                 "bf16_kernel")
    with dependent_launch():
        again = gv.decode_linear_triton(x * 1.0, w, b)  # a kernel right before
    assert torch.equal(again, got)
