"""research.perf.op_count on the GPU side: CUDA kernels of one decode step by torch.profiler (eager per layer,
replayed, compiled; GPU tests), their grouping by layer scope, and where torch.compile of the step breaks its
graph (CPU: only at the decode-time weight caches of hybrid.layers.common)."""
from types import SimpleNamespace

import pytest
import torch

from headscope.heads import Head
from headscope.mask import HeadMask
from hybrid.builders import from_teacher
from hybrid.convert import from_mask
from research.perf.op_count import count_cuda_kernels, graph_breaks, group_kernels

from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def hybrid_7to1(teacher):  # per layer one whole KV group FA, the rest GDN
    fa = [Head(layer=l, head=(l % 2) * 2 + r) for l in range(2) for r in range(2)]
    return from_mask(teacher, HeadMask.for_model(teacher, fa)).eval()


def test_group_kernels_by_enclosing_layer_range():
    layer = SimpleNamespace(name="decode_layer 1", cpu_parent=None, kernels=[])
    mm = SimpleNamespace(name="aten::mm", cpu_parent=layer, kernels=[SimpleNamespace(name="gemv")])
    deep = SimpleNamespace(name="aten::copy_", cpu_parent=SimpleNamespace(name="aten::to", cpu_parent=layer),
                           kernels=[SimpleNamespace(name="Memcpy DtoD"), SimpleNamespace(name="elementwise")])
    out = SimpleNamespace(name="aten::embedding", cpu_parent=None, kernels=[SimpleNamespace(name="gather")])
    got = group_kernels([layer, mm, deep, out])
    assert got == {"layer 1": {"gemv": 1, "memcpy": 1, "elementwise": 1}, "outside": {"gather": 1}}


@pytest.mark.parametrize("name", ["teacher", "hybrid"])
def test_the_compiled_decode_step_is_one_graph_on_the_cpu(name):
    """On the CPU every op is traceable (the PyTorch twins), and the decode weight caches (fused_linear,
    inference_constant), made by an eager step first, are read without comparing data pointers: one graph, no
    break (there were 5 per hybrid layer at the caches). On CUDA fla's recurrent kernel and the Triton prologue
    are compiler-disabled: breaks there (research/count_decode_ops.py --device cuda --breaks)."""
    teacher = tiny_model("qwen3", dtype=torch.float32, num_hidden_layers=2)
    model = from_teacher(teacher).eval() if name == "teacher" else hybrid_7to1(teacher)
    b = graph_breaks(model, batch=1, context=8)
    assert (b["graphs"], b["breaks"], b["reasons"]) == (1, 0, {})
    assert any(m.__dict__.get("_fused_linears") for m in model.modules())  # made by the eager step, then read


def test_cuda_counter_refuses_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="CUDA"):
        count_cuda_kernels(from_teacher(tiny_model("qwen3", num_hidden_layers=1)).eval())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["teacher", "hybrid"])
def test_gpu_kernel_counts_are_positive_and_compiling_does_not_add_kernels(name):
    import torch._dynamo

    torch._dynamo.reset()
    teacher = tiny_model("qwen3", num_hidden_layers=2, head_dim=64).to("cuda", torch.bfloat16)
    model = (from_teacher(teacher).eval() if name == "teacher" else hybrid_7to1(teacher)).cuda()
    eager = count_cuda_kernels(model, batch=1)
    graph = count_cuda_kernels(model, batch=1, cuda_graph=True)
    compiled = count_cuda_kernels(model, batch=1, compile=True)
    both = count_cuda_kernels(model, batch=1, compile=True, cuda_graph=True)
    print(name, {k: (r["total"], r["per_layer"]) for k, r in
                 dict(eager=eager, graph=graph, compiled=compiled, both=both).items()},
          "scoped per layer", eager["scoped_per_layer"])
    assert eager["total"] > 0 and eager["scoped_per_layer"] > 0 and "layer 0" in eager["scoped"]
    assert eager["scoped_per_layer"] * eager["layers"] <= eager["total"]
    assert compiled["total"] > 0 and compiled["total"] <= eager["total"]
    assert both["total"] <= eager["total"]
    if graph["total"] > 0:  # the profiler reports kernels inside a graph replay (CUPTI): the same step's kernels
        assert abs(graph["total"] - eager["total"]) <= 0.1 * eager["total"] + 2
    torch._dynamo.reset()
