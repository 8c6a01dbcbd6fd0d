"""The CUDA path's kernels as torch.library custom ops (hybrid::decode_attention, hybrid::gdn_qk_prologue,
hybrid::fla_recurrent_gated_delta_rule, hybrid::gdn_decode_step), checked on the CPU, where each op's kernel is its
PyTorch twin: opcheck (schema, declared mutation, fake kernel, AOT dispatch), equality with the twin, and zero graph
breaks when a function calling the public op on that path (``custom_ops_on_cpu()``) is compiled. The availability
checks (triton_available, fla_available, flash_available) are cached eagerly and constants under torch.compile."""
import importlib
import warnings

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F

import hybrid.ops.gdn as gdn
import hybrid.ops.gdn_decode as gd
import hybrid.ops.prologue as pro
from hybrid.ops.attention import flash_available
from hybrid.ops.utils import custom_ops_on_cpu, fast_device, kernels_assumed
from research.perf.op_count import custom_ops_in

from testing_utils import assert_close

da = importlib.import_module("hybrid.ops.decode_attention")  # the package's attribute is the function
pytestmark = pytest.mark.usefixtures("one_thread")
OPS = ("decode_attention", "gdn_qk_prologue", "fla_recurrent_gated_delta_rule", "gdn_decode_step")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def attn_args(window=None, seed=0):
    g = gen(seed)
    q = torch.randn(2, 1, 4, 16, generator=g)  # [B, 1, H, D]
    k, v = torch.randn(2, 20, 2, 16, generator=g), torch.randn(2, 20, 2, 16, generator=g)  # [B, S, K, D]
    return q, k, v, torch.tensor([5, 20]), 0.3, window  # kv_len [B], scale, window


def prologue_args(norm=True, per_row=False, seed=0):
    g = gen(seed)
    q, k = torch.randn(2, 3, 2, 16, generator=g), torch.randn(2, 3, 2, 16, generator=g)  # [B, T, H, D]
    wq, wk = 1 + 0.1 * torch.randn(16, generator=g), 1 + 0.1 * torch.randn(16, generator=g)  # [D]
    shape = (2, 3, 16) if per_row else (3, 16)  # [B, T, D] or [T, D]
    ang = torch.randn(*shape, generator=g)
    return q, k, (wq if norm else None), (wk if norm else None), ang.cos(), ang.sin(), 1e-6, norm


def gdn_args(h0=True, final=True, l2=False, scale=0.3, seed=0):
    g = gen(seed)
    B, T, H, Dk, Dv = 2, 3, 2, 8, 6
    q = torch.randn(B, T, H, Dk, generator=g)
    k = F.normalize(torch.randn(B, T, H, Dk, generator=g), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=g)
    lg = F.logsigmoid(torch.randn(B, T, H, generator=g))  # [B, T, H] log decay
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, Dk, Dv, generator=g) if h0 else None
    return q, k, v, lg, beta, scale, state, final, l2


def decode_step_args(decay="gdn", norm=True, per_row=False, seed=0):
    g = gen(seed)
    B, H, D = 2, 3, 16
    q, k, v = (torch.randn(B, 1, H, D, generator=g) for _ in range(3))  # [B, 1, H, D]
    b, a = torch.randn(B, 1, H, generator=g), torch.randn(B, 1, H, generator=g)  # [B, 1, H]
    state = 0.1 * torch.randn(B, H, D, D, generator=g)  # [B, H, D, D] float32
    wq, wk = 1 + 0.1 * torch.randn(D, generator=g), 1 + 0.1 * torch.randn(D, generator=g)
    ang = torch.randn(*((B, 1, D) if per_row else (1, D)), generator=g)
    p = torch.randn(H, generator=g)  # [H]
    A_log, dt_bias, a_bias = (p, 0.5 * p, None) if decay == "gdn" else (None, None, p)
    return (q, k, v, b, a, state, wq if norm else None, wk if norm else None, ang.cos(), ang.sin(), 1e-6, norm, decay,
            A_log, dt_bias, a_bias, D ** -0.5)


# ---- the ops themselves: opcheck and their twins ------------------------------------------------------------------
OPCHECK_CASES = {
    "decode_attention": [attn_args(), attn_args(window=7, seed=1)],
    "gdn_qk_prologue": [prologue_args(), prologue_args(norm=False, per_row=True, seed=1)],
    "fla_recurrent_gated_delta_rule": [gdn_args(), gdn_args(h0=False, final=False, l2=True, scale=None, seed=1)],
    "gdn_decode_step": [decode_step_args(), decode_step_args("simple", norm=False, per_row=True, seed=1)],
}


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    """Schema (the declared in-place write of gdn_decode_step's state included), fake kernel against the CPU
    kernel, AOT dispatch with static and dynamic shapes."""
    op = getattr(torch.ops.hybrid, name)
    assert op.default._schema.is_mutable == (name == "gdn_decode_step")
    for args in OPCHECK_CASES[name]:
        torch.library.opcheck(op.default, args)


@pytest.mark.parametrize("window", [None, 7])
def test_decode_attention_op_equals_its_twin(window):
    args = attn_args(window)
    got = torch.ops.hybrid.decode_attention(*args)  # [B, 1, H, D]
    assert got.is_contiguous() and got.shape == args[0].shape
    assert_close("decode_attention op", got, da.decode_attention_reference(*args), "fp32")


@pytest.mark.parametrize("norm,per_row", [(True, False), (False, True)])
def test_prologue_op_equals_its_twin(norm, per_row):
    args = prologue_args(norm, per_row)
    for got, ref in zip(torch.ops.hybrid.gdn_qk_prologue(*args), pro.prologue_reference(*args)):
        assert got.dtype == args[0].dtype and got.is_contiguous()
        assert_close("prologue op", got, ref, "fp32")


@pytest.mark.parametrize("h0,final,l2", [(True, True, False), (False, True, True), (True, False, False)])
def test_fla_recurrent_op_equals_its_twin(h0, final, l2):
    args = gdn_args(h0, final, l2)
    o, ht = torch.ops.hybrid.fla_recurrent_gated_delta_rule(*args)
    o_ref, ht_ref = gdn.torch_recurrent_gated_delta_rule(*args)
    assert_close("o", o, o_ref, "fp32")
    if final:
        assert_close("final state", ht, ht_ref, "fp32")
    else:
        assert ht.numel() == 0 and ht_ref is None  # no state: an empty tensor from the op, None from the wrapper


@pytest.mark.parametrize("decay,norm", [("gdn", True), ("simple", False)])
def test_gdn_decode_op_equals_its_twin_and_steps_the_state_in_place(decay, norm):
    args = list(decode_step_args(decay, norm))
    state = args[5]
    s_ref, ptr = state.clone(), state.data_ptr()
    ref_args = list(args)
    ref_args[5] = s_ref
    got = torch.ops.hybrid.gdn_decode_step(*args)
    ref = gd.gdn_decode_step_reference(*ref_args[:10], eps=args[10], norm=norm, decay=decay, A_log=args[13],
                                       dt_bias=args[14], a_bias=args[15], scale=args[16])
    assert_close("o", got, ref, "fp32")
    assert_close("state", state, s_ref, "fp32")
    assert state.data_ptr() == ptr and not torch.equal(state, decode_step_args(decay, norm)[5])


# ---- the public functions: which path takes the op, and compiling it ----------------------------------------------
def explain(fn, *args):
    dynamo.reset()
    ex = dynamo.explain(fn)(*args)
    dynamo.reset()
    return ex


def public_calls():
    """name -> (function calling the public op on its CUDA path, its args, the public op on the twin's path)."""
    def attn(q, k, v, kv_len):
        return da.decode_attention(q, k, v, kv_len, 0.3, None) * 2

    def prologue(q, k, wq, wk, cos, sin):
        a, b = pro.gdn_qk_prologue(q, k, wq, wk, cos, sin)
        return a + b

    def rule(q, k, v, lg, beta, h0):
        o, ht = gdn.gated_delta_rule(q, k, v, lg, beta, initial_state=h0, output_final_state=True,
                                     backend="auto", fold_heads=True)
        return o.sum() + ht.sum()

    def rule_explicit(q, k, v, lg, beta, h0):
        o, ht = gdn.gated_delta_rule(q, k, v, lg, beta, initial_state=h0, output_final_state=True,
                                     backend="fla_recurrent")
        return o.sum() + ht.sum()

    def step(*a):
        q, k, v, b, c, state, wq, wk, cos, sin = a
        return gd.gdn_decode_step(q, k, v, b, c, state, wq, wk, cos, sin, A_log=wq[:3], dt_bias=wk[:3]) + 1

    s = decode_step_args()
    return {
        "decode_attention": (attn, attn_args()[:4]),
        "gdn_qk_prologue": (prologue, prologue_args()[:6]),
        "fla_recurrent_gated_delta_rule": (rule, gdn_args()[:5] + (gdn_args()[6],)),
        "fla_recurrent_explicit": (rule_explicit, gdn_args()[:5] + (gdn_args()[6],)),
        "gdn_decode_step": (step, s[:10]),
    }


@pytest.mark.parametrize("case", ["decode_attention", "gdn_qk_prologue", "fla_recurrent_gated_delta_rule",
                                  "fla_recurrent_explicit", "gdn_decode_step"])
@torch.no_grad()
def test_public_op_on_the_cuda_path_compiles_to_one_graph_with_its_custom_op(case):
    fn, args = public_calls()[case]
    op = "hybrid::" + ("fla_recurrent_gated_delta_rule" if case == "fla_recurrent_explicit" else case)
    clone = lambda: [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # noqa: E731
    twin_fn = public_calls()["fla_recurrent_gated_delta_rule"][0] if case == "fla_recurrent_explicit" else fn
    eager_twin = twin_fn(*clone())  # CPU, no switch: the PyTorch twins ("fla_recurrent" itself needs CUDA there)
    ex = explain(twin_fn, *clone())
    assert (ex.graph_count, ex.graph_break_count) == (1, 0) and op not in custom_ops_in(ex.graphs)
    with custom_ops_on_cpu():
        eager_op = fn(*clone())  # the CUDA path's dispatch: the custom op (its CPU kernel)
        ex = explain(fn, *clone())
        assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
        assert custom_ops_in(ex.graphs)[op] == 1
        dynamo.reset()
        inputs = clone()
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(*inputs)  # functionalized (state write)
        dynamo.reset()
    assert_close(f"{case}: op path vs twin", eager_op, eager_twin, "fp32")
    assert_close(f"{case}: compiled vs eager", compiled, eager_op, "fp32")
    if case == "gdn_decode_step":  # the compiled call wrote the state in place, as the eager one
        ref = clone()
        gd.gdn_decode_step(*ref[:10], A_log=ref[6][:3], dt_bias=ref[7][:3])
        assert_close("state after the compiled step", inputs[5], ref[5], "fp32")


def test_the_training_path_keeps_the_compiler_disabled_autograd_function(monkeypatch):
    """A gradient needed: the prologue runs prologue_triton (autograd Function; a graph break under compile), not
    the forward-only op; under no_grad the op."""
    calls = []

    def spy(*a):
        calls.append(1)
        return pro.prologue_reference(*a)

    monkeypatch.setattr(pro, "prologue_triton", spy)
    q, k, wq, wk, cos, sin, eps, norm = prologue_args()
    wq.requires_grad_(True)
    with custom_ops_on_cpu():
        pro.gdn_qk_prologue(q, k, wq, wk, cos, sin)
        assert calls == [1]
        with torch.no_grad():
            pro.gdn_qk_prologue(q, k, wq, wk, cos, sin)
        assert calls == [1]
        with pytest.raises(ValueError, match="no gradient for cos/sin"):  # as before, with and without grad
            with torch.no_grad():
                pro.gdn_qk_prologue(q, k, wq, wk, cos.requires_grad_(True), sin)
        with pytest.raises(RuntimeError, match="no backward in fla"):
            a = gdn_args()
            gdn.gated_delta_rule(a[0].requires_grad_(True), *a[1:5], backend="fla_recurrent")


def test_errors_outside_the_switch_are_unchanged():
    q = torch.zeros(1, 1, 2, 16)
    assert not kernels_assumed() and not fast_device(q)
    if not pro.triton_available():
        with pytest.raises(ImportError, match="needs Triton"):
            da.resolve_backend("triton", q)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        gdn.resolve_backend("fla_recurrent", q, needs_grad=False)
    with custom_ops_on_cpu():
        assert fast_device(q) and da.resolve_backend("auto", q) == "triton"
        assert gdn.resolve_backend("auto", q, needs_grad=False) == "fla_recurrent"
        assert gdn.resolve_backend("auto", q, needs_grad=True) == "fla_chunk"
        assert gd.resolve_backend("auto", q) == "triton" and pro.resolve_backend("auto", q) == "triton"
        assert pro.resolve_backend("auto", q.double()) == "torch"  # float64 keeps the twin, as on CUDA
        with pytest.raises(ValueError, match="float32 state"):  # the kernel's own errors, before the op
            args = list(decode_step_args())
            gd.gdn_decode_step(*args[:5], args[5].double(), *args[6:10], A_log=args[13], dt_bias=args[14])
    assert not kernels_assumed()


# ---- availability checks: cached, and constants under torch.compile ---------------------------------------------
CHECKS = {
    "prologue": lambda x: pro.resolve_backend("auto", x) == "torch",
    "decode_attention": lambda x: da.resolve_backend("auto", x) == "torch",
    "gdn_decode": lambda x: gd.resolve_backend("auto", x) == "torch",
    "gdn": lambda x: gdn.resolve_backend("auto", x, needs_grad=False) == "torch_recurrent",
    "flash": lambda x: not flash_available(),
}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_availability_checks_are_constants_under_compile(name):
    """resolve_backend (which asks whether Triton / fla import) compiles without a break and without dynamo's
    warning that it traces through a functools.lru_cache wrapper (it traced the imports, into Triton's knobs)."""
    check = CHECKS[name]

    def f(x):
        return x + 1 if check(x) else x - 1

    x = torch.zeros(1, 1, 1, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex = explain(f, x)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    dynamo.reset()
    assert torch.equal(torch.compile(f, backend="eager", fullgraph=True)(x), f(x))
    dynamo.reset()


def test_availability_checks_keep_functools_cache_semantics():
    for fn in (pro.triton_available, gdn.fla_available, flash_available):
        value = fn()
        hits = fn.cache_info().hits
        assert fn() is value and fn.cache_info().hits == hits + 1 and fn.cache_info().currsize == 1
        fn.cache_clear()
        assert fn.cache_info().currsize == 0 and fn() is value


def test_dependent_launch_is_a_switch_that_restores_itself_and_never_applies_on_the_cpu():
    from hybrid.ops import utils

    x = torch.zeros(2)
    assert not utils.pdl_launch(x) and not utils.pdl_supported(x)
    with utils.dependent_launch():
        assert utils._PDL and not utils.pdl_launch(x)  # the CPU has no PDL
        with utils.dependent_launch(False):
            assert not utils._PDL
        assert utils._PDL
    assert not utils._PDL
    with pytest.raises(RuntimeError), utils.dependent_launch():
        raise RuntimeError("restored on the way out")
    assert not utils._PDL
