"""research.perf.op_count: kernels per layer of one decode step (CPU count), pinned so regressions show; the fused
decode projections (common.fused_linear) and cached parameter constants give the separate Linears' values and
follow parameter updates."""
import pytest
import torch

from headscope.heads import Head
from headscope.mask import HeadMask
from hybrid.builders import from_teacher
from hybrid.convert import from_mask
from hybrid.layers.common import RMSNorm, fused_linear, inference_constant
from research.perf.op_count import count_step, layer_ops, summarize

from hybrid.decoding import Decoder, prefill

from model_factories import tiny_model
from testing_utils import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")


def teacher_bf16():
    return tiny_model("qwen3", dtype=torch.bfloat16, num_hidden_layers=2)


def hybrid_7to1(teacher):  # per layer one whole KV group FA (heads 2l%4.. of KV head l%2), the rest GDN
    fa = [Head(layer=l, head=(l % 2) * 2 + r) for l in range(2) for r in range(2)]
    return from_mask(teacher, HeadMask.for_model(teacher, fa)).eval()


# measured with research/count_decode_ops.py (bf16): before this bound, 58 (hybrid) and 37 (teacher)
@pytest.mark.parametrize("batch, hybrid_max, teacher_max", [(1, 41, 31), (3, 44, 31)])
def test_kernel_ops_per_layer_of_a_decode_step_stay_bounded(batch, hybrid_max, teacher_max):
    teacher = teacher_bf16()
    h = layer_ops(hybrid_7to1(teacher), batch=batch)
    t = layer_ops(from_teacher(teacher).eval(), batch=batch)
    assert h <= hybrid_max, f"hybrid decode step: {h} kernel ops per layer > {hybrid_max} (see docs/hybrid.md)"
    assert t <= teacher_max, f"teacher decode step: {t} kernel ops per layer > {teacher_max}"
    assert h > 20 and t > 20  # the counter sees the layers at all


def test_count_does_not_grow_with_the_context():
    model = hybrid_7to1(teacher_bf16())
    short, long = (summarize(count_step(model, batch=2, context=n)) for n in (8, 64))
    assert short["per_layer_ops"] == long["per_layer_ops"] and short["outside"] == long["outside"]


def test_fused_linear_equals_the_separate_linears_and_follows_updates():
    torch.manual_seed(0)
    owner = torch.nn.Module()
    lins = [torch.nn.Linear(8, 6, bias=False, dtype=torch.float64), torch.nn.Linear(8, 3, dtype=torch.float64),
            torch.nn.Linear(8, 2, bias=False, dtype=torch.float64)]
    x = torch.randn(2, 1, 8, dtype=torch.float64)
    with torch.no_grad():  # the same dot products (MKL may sum them in another order: the last bit)
        for got, lin in zip(fused_linear(owner, "p", lins, x), lins):
            assert_close("fused", got, lin(x), "fp64_exact")
        a, bc = fused_linear(owner, "g", lins, x, groups=(1, 2))
        assert_close("group", bc, torch.cat([lins[1](x), lins[2](x)], -1), "fp64_exact")
        lins[1].weight.add_(1.0)  # an optimizer-style in-place update: the fused copy is rebuilt
        assert_close("updated", fused_linear(owner, "p", lins, x)[1], lins[1](x), "fp64_exact")
    out = fused_linear(owner, "p", lins, x)  # under autograd: the separate Linears, gradients reach them
    out[1].sum().backward()
    assert lins[1].weight.grad is not None
    seen = []
    handle = lins[2].register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        fused_linear(owner, "p", lins, x)  # a hooked Linear: the separate Linears run, so the hook sees its output
    handle.remove()
    assert len(seen) == 1
    with pytest.raises(ValueError, match="groups"):
        fused_linear(owner, "p", lins, x, groups=(1, 1))


def test_inference_constant_is_cached_and_rebuilt_on_update():
    owner = torch.nn.Module()
    p = torch.nn.Parameter(torch.zeros(3))
    calls = []

    def fn():
        calls.append(1)
        return -p.exp()

    with torch.no_grad():
        first = inference_constant(owner, "c", (p,), fn)
        assert inference_constant(owner, "c", (p,), fn) is first and len(calls) == 1
        p.add_(1.0)
        assert torch.equal(inference_constant(owner, "c", (p,), fn), -p.exp()) and len(calls) == 2
    assert inference_constant(owner, "c", (p,), fn).requires_grad  # under autograd: recomputed, differentiable


def test_under_compile_the_caches_are_read_without_a_key_only_where_trusted():
    """torch.compile inside trusted_inference_caches() (the Decoder's compiled step): no data-pointer check (a
    graph break); a cached copy is used as it is, and without one the separate Linears run / the constant is
    computed in the graph. Outside it the check stays: a parameter updated after the caches were made is seen."""
    import torch._dynamo

    from hybrid.layers.common import trusted_inference_caches

    torch.manual_seed(0)
    lins = [torch.nn.Linear(8, 6, bias=False, dtype=torch.float64), torch.nn.Linear(8, 3, dtype=torch.float64)]
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    x = torch.randn(2, 1, 8, dtype=torch.float64)

    def step(owner):
        a, b = fused_linear(owner, "p", lins, x)  # [2, 1, 6], [2, 1, 3]
        return a.sum(-1) + b.sum(-1) + inference_constant(owner, "c", (p,), lambda: -p.exp()).sum()  # [2, 1]

    def want():
        return torch.cat([lin(x) for lin in lins], -1).sum(-1) - p.exp().sum()  # [2, 1]

    with torch.no_grad():
        for primed in (False, True):
            owner = torch.nn.Module()
            if primed:
                step(owner)  # the eager call that makes the copies
            torch._dynamo.reset()
            with trusted_inference_caches():
                ex = torch._dynamo.explain(step)(owner)
                got = torch.compile(step, backend="aot_eager")(owner)
            assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
            assert_close(f"compiled, primed={primed}", got, want(), "fp64_exact")
            assert ("_fused_linears" in owner.__dict__) == primed  # nothing is cached from inside a graph
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="aot_eager")
        assert_close("untrusted", compiled(owner), want(), "fp64_exact")
        lins[1].weight.add_(1.0)  # updated after the caches were made (a training step)
        p.add_(0.5)
        assert_close("untrusted after an update", compiled(owner), want(), "fp64_exact")
        assert torch._dynamo.explain(step)(owner).graph_break_count > 0  # the key check: a break, not a stale copy
    torch._dynamo.reset()


def test_rmsnorm_half_path_equals_the_float32_reference():
    torch.manual_seed(0)
    norm = RMSNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 64).to(torch.bfloat16) * 7
    ref = norm.weight * torch.nn.functional.rms_norm(x.float(), (64,), eps=norm.eps).to(x.dtype)
    assert torch.equal(norm(x), ref)


@pytest.mark.parametrize("rows", [1, 2])  # one row: the GDN's five-in-one matmul; several: q/k/v separate, b/a fused
@pytest.mark.parametrize("fa_layers", [None, "hybrid"])
def test_decoding_with_fused_projections_equals_the_separate_linears(fa_layers, rows):
    teacher = tiny_model("qwen3", dtype=torch.float64, num_hidden_layers=2)
    model = from_teacher(teacher).eval() if fa_layers is None else hybrid_7to1(teacher)
    with torch.no_grad():
        for p in model.new_parameters().values():  # off init: gates and decays matter
            p.add_(torch.randn_like(p) * 0.1)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 128, (n,)) for n in (7, 4)[:rows]]
    outs = []
    full = model(torch.cat([prompts[0], torch.tensor([3, 3])])[None], use_cache=False).logits[0, -2:]  # [2, V]
    for fuse in (True, False):
        cache, _ = prefill(model, prompts, 3)
        cache.fuse_projections = fuse
        assert cache.fuse_projections is fuse
        dec = Decoder(model, cache)
        ids = torch.tensor([[3], [5]])[:rows]
        outs.append(torch.stack([dec.step(ids) for _ in range(2)]))  # [2, B, V]
    assert_close("fused vs separate", outs[0], outs[1], "fp64_exact")
    assert_close("fused vs full forward", outs[0][:, 0], full, "fp64_exact")
