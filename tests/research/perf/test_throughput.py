"""research.perf.throughput: the profiler's kernel categories and the profile of a step."""
from __future__ import annotations

import pytest
import torch

from research.perf.throughput import KERNEL_CATEGORIES, kernel_category, profile_step

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("aten::mm", "matmul"),
    ("aten::addmm", "matmul"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn"),
    ("chunk_fwd_kernel_o", "gdn"),
    ("solve_tril_16x16_kernel", "gdn"),
    ("prepare_wy_repr_bwd_kernel", "gdn"),
    ("_prologue_fwd_kernel", "gdn"),
    ("flash_fwd_kernel", "attention"),
    ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
    ("cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>", "loss"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("some_new_kernel", "other"),
])
def test_kernel_names_fall_into_their_category(name, category):
    assert kernel_category(name) == category
    assert category == "other" or category in dict(KERNEL_CATEGORIES)


@pytest.mark.parametrize("name, annotation", [
    ("## Call CompiledFxGraph fbmuqlynqnjq2ffcovqaiqkgtqwt3chyhu4nkxmyfabex7uhex5k ##", True),
    ("ProfilerStep#3", True),
    ("triton_red_fused__log_softmax__to_copy_amax", False),
    ("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN", False),
])
def test_named_ranges_on_the_gpu_timeline_are_not_kernels(name, annotation):
    from research.perf.throughput import _is_annotation

    assert _is_annotation(name) is annotation


def test_profile_of_a_cpu_step_counts_its_matmuls():
    # matmuls large enough (2 x 134 MFLOP a step) to lead the self-CPU-time list whatever the machine's noise: at
    # [64, 256] x [256, 256] aten::mm once fell out of the top 5 under a loaded CI run
    w = torch.randn(512, 512, requires_grad=True)  # [D, D]
    x = torch.randn(256, 512)  # [N, D]

    def step():
        y = (x @ w).relu().sum()
        y.backward()

    prof = profile_step(step, torch.device("cpu"), steps=2, top=5)
    assert prof["timer"] == "self CPU time of aten ops" and prof["step_ms"] > 0
    assert len(prof["top"]) <= 5 and prof["top"][0]["ms"] >= prof["top"][-1]["ms"]
    assert prof["categories"]["matmul"]["share"] > 0
    assert abs(sum(c["share"] for c in prof["categories"].values()) - 1) < 1e-2
    assert {r["calls"] for r in prof["top"] if r["name"] == "aten::mm"} == {2}  # forward + the grad of w (x needs none), per step


def test_profile_names_the_eager_elementwise_ops_by_dtype_shape_and_source_line():
    """ops_top: a float32 add and a bf16 cast of known shapes, issued by this file, come back grouped by op,
    dtypes and shapes, with the line that issued them; shapes=False leaves the list out."""
    a = torch.randn(32, 1024)  # [N, C]
    b = torch.randn(32, 1024)  # [N, C]

    def step():
        for _ in range(3):
            c = a + b  # [N, C] float32
        c.to(torch.bfloat16)

    prof = profile_step(step, torch.device("cpu"), steps=2, top=10)
    adds = [r for r in prof["ops_top"] if r["op"] == "aten::add"]
    assert adds and adds[0]["calls"] == 3 and adds[0]["dtypes"] == "['float', 'float']"
    assert adds[0]["shapes"] == "[[32, 1024], [32, 1024]]" and "test_throughput.py" in adds[0]["where"]
    assert any(r["op"] == "aten::copy_" and "BFloat16" in r["dtypes"] for r in prof["ops_top"])
    lines = __import__("research.perf.sweep", fromlist=["profile_lines"]).profile_lines("cpu step", prof)
    assert any(line.startswith("[profile]   op ") and "aten::add ['float', 'float']" in line for line in lines)
    assert "ops_top" not in profile_step(step, torch.device("cpu"), steps=1, shapes=False)


def test_the_source_line_of_an_op_is_found_on_profilers_of_older_torch():
    """torch < 2.12 has no FunctionEvent.is_python_function (the H200 image's 2.11 failed here): a parent named like a
    Python frame counts, torch's own frames are skipped, and without such a parent the op's own stack answers."""
    from types import SimpleNamespace as E

    from research.perf.throughput import _where

    engine = E(name="autograd::engine::evaluate_function: AddBackward0", cpu_parent=None)
    ours = E(name="hybrid/layers/gdn.py(88): forward", cpu_parent=engine)
    torch_frame = E(name="torch/nn/modules/module.py(1750): _call_impl", cpu_parent=ours)
    assert _where(E(name="aten::add", cpu_parent=torch_frame)) == "hybrid/layers/gdn.py(88): forward"
    assert _where(E(name="aten::add", cpu_parent=engine, stack=["torch/autograd/graph.py(824): _engine_run_backward",
                                                                 "hybrid/train/fused_loss.py(140): backward"])) \
        == "hybrid/train/fused_loss.py(140): backward"
    assert _where(E(name="aten::add", cpu_parent=engine)) == ""
    not_python = E(name="hybrid/layers/gdn.py(88): forward", cpu_parent=None, is_python_function=False)
    assert _where(E(name="aten::add", cpu_parent=not_python)) == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_of_a_cuda_step_times_its_kernels_and_its_host_side():
    """On CUDA: device kernels by self CUDA time, and the host side of the same step (launch count, self CPU time
    of the CPU-side events) for a step whose GPU waits on the CPU."""
    dev = torch.device("cuda")
    w = torch.randn(512, 512, device=dev, requires_grad=True)  # [D, D]
    x = torch.randn(256, 512, device=dev)  # [N, D]

    def step():
        y = (x @ w).relu().sum()
        y.backward()

    prof = profile_step(step, dev, steps=2, top=5)
    assert prof["timer"] == "self CUDA time of device kernels" and prof["categories"]["matmul"]["share"] > 0
    assert prof["kernels_per_step"] >= 3  # forward mm, relu, the grad's mm at least
    assert prof["host_ms_per_step"] > 0 and prof["host_top"] and len(prof["host_top"]) <= 5
    assert prof["host_top"][0]["ms"] >= prof["host_top"][-1]["ms"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_of_a_compiled_cuda_step_counts_its_kernels_once():
    """A compiled region's range ("## Call CompiledFxGraph ... ##") also shows on the GPU timeline on torch 2.11,
    spanning the region's kernels: it is left out, so the kernels' sum is not counted twice."""
    dev = torch.device("cuda")
    w = torch.randn(1024, 1024, device=dev, requires_grad=True)  # [D, D]
    x = torch.randn(4096, 1024, device=dev)  # [N, D]
    f = torch.compile(lambda x, w: torch.nn.functional.silu(x @ w).square().mean())

    def step():
        f(x, w).backward()

    step()  # compiles
    prof = profile_step(step, dev, steps=3, top=25)
    assert not any(r["name"].startswith("## ") for r in prof["top"])
    assert prof["categories"]["matmul"]["share"] > 0.3  # three [4096, 1024] x [1024, 1024] matmuls dominate
    assert prof["kernel_ms_per_step"] <= prof["step_ms"] * 1.05  # kernels on one stream fit in the step


def test_copy_model_keeps_compiled_submodules_compiled():
    """copy.deepcopy drops nn.Module.compile (Module.__getstate__ pops _compiled_call_impl): measure_distill's copy
    of a compiled student ran eagerly. copy_model compiles the same submodules again on the copy, which computes
    with its own weights."""
    import copy

    from hybrid.train.build import copy_model
    from research.perf.throughput import compiled_modules

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model[0].compile()
    model[2].compile()
    assert copy.deepcopy(model)[0]._compiled_call_impl is None  # the bug this helper works around
    twin = copy_model(model)
    assert [twin[i]._compiled_call_impl is not None for i in range(3)] == [True, False, True]
    assert compiled_modules(twin) == compiled_modules(model) == 2 and compiled_modules(copy.deepcopy(model)) == 0
    assert twin[0]._compiled_call_impl is not model[0]._compiled_call_impl
    assert twin[0].weight is not model[0].weight
    torch.testing.assert_close(twin[0].weight, model[0].weight)


def test_compile_decoder_layers_takes_a_mode_and_copies_keep_it():
    """compile_decoder_layers(mode=...): torch.compile's mode on every layer ("reduce-overhead": CUDA graphs for a
    host-bound step), recorded on the layer so that copy_model (measure_distill's copy) compiles the same way; an
    unknown mode is refused before anything compiles."""
    from types import SimpleNamespace

    from hybrid.train.build import compile_decoder_layers, compiled_submodules, copy_model

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    with pytest.raises(ValueError, match="compile mode='fast'.*reduce-overhead"):
        compile_decoder_layers(model, mode="fast")
    assert compiled_submodules(model) == []
    assert compile_decoder_layers(model, mode="reduce-overhead") == 3
    twin = copy_model(model)
    assert compiled_submodules(twin) == [f"model.layers.{i}" for i in range(3)]
    assert {layer._compile_mode for layer in twin.model.layers} == {"reduce-overhead"}
    with pytest.raises(TypeError, match="no .model.layers"):
        compile_decoder_layers(SimpleNamespace())
