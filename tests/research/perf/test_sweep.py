"""research.perf.sweep: the stage-2 throughput sweep (run.py --throughput-only's engine) on a tiny teacher."""
from __future__ import annotations

import json

import pytest
import torch

from research.perf.sweep import SweepConfig, profile_lines, run_sweep

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kw, match", [
    ({"batches": ()}, "batches=()"),
    ({"batches": (0,)}, "positive batch sizes"),
    ({"seq_len": 0}, "seq_len=0"),
    ({"warmup": -1}, "warmup=-1"),
    ({"compile_mode": "fast"}, "compile_mode='fast'.*reduce-overhead"),
    ({"compiled_only": True}, "set compile=True"),
    ({"bf16_weights": True}, "bf16_weights=True is a side run of the compiled student: set compile=True"),
])
def test_bad_sweep_configs_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SweepConfig(**{"batches": (1,), "seq_len": 16, **kw})


def test_sweep_times_each_batch_writes_as_it_goes_and_picks_the_best(tiny_qwen3, tmp_path):
    """Two batch sizes with the naive-loss side run: every row holds the eager step, the teacher's step and the side
    run; the file on disk is the rows so far while the sweep runs (here: its last state, all rows); the best eager
    row by tokens/s is the result; the log says each measurement as it is taken."""
    from hybrid.builders import from_teacher

    student = from_teacher(tiny_qwen3)  # a HybridForCausalLM (every head FA): what the sweep times is the step
    out, lines = tmp_path / "throughput.json", []
    cfg = SweepConfig(batches=(1, 2), seq_len=16, steps=1, warmup=0, compare_naive=True, profile=True)
    swept = run_sweep(student, tiny_qwen3, cfg, out_path=out, log=lines.append)
    assert [r["batch_size"] for r in swept["rows"]] == [1, 2]
    for r in swept["rows"]:
        assert {"distill", "teacher_train", "distill_naive"} <= set(r) and r["distill_naive"]["fused_loss"] is False
    best = swept["best"]
    assert best["distill"] == max((r["distill"] for r in swept["rows"]), key=lambda d: d["tokens_per_s"])
    on_disk = json.loads(out.read_text())
    assert on_disk["partial"] is True and len(on_disk["rows"]) == 2  # the caller writes the final file
    assert sum("naive loss" in line for line in lines) >= 2 and any(line.startswith("[profile] batch 2 distill:")
                                                                   for line in lines)


def test_profile_lines_print_categories_kernels_and_the_host_side():
    prof = {"step_ms": 10.0, "kernel_ms_per_step": 8.0, "timer": "self CUDA time of device kernels",
            "categories": {"matmul": {"ms": 6.0, "share": 0.75}, "copy": {"ms": 2.0, "share": 0.25}},
            "top": [{"name": "gemm", "category": "matmul", "ms": 6.0, "calls": 3, "share": 0.75}],
            "kernels_per_step": 40, "host_ms_per_step": 12.5, "host_top": [{"name": "cudaLaunchKernel", "ms": 5.0,
                                                                             "calls": 40}]}
    lines = profile_lines("batch 2 distill", prof)
    assert lines[0].startswith("[profile] batch 2 distill: 10.0 ms a step") and "matmul 75%" in lines[0]
    assert "gemm" in lines[1] and "40 kernel launches" in lines[2] and "cudaLaunchKernel" in lines[3]



def test_cuda_graph_modes_are_refused_on_cuda_before_anything_runs(tiny_qwen3):
    """--compile-mode reduce-overhead failed in the stage-2 step on the H200 (CUDA graphs): refused there with the
    reason and the mode to use; on the CPU (no CUDA graphs) every mode compiles."""
    from research.perf.sweep import CUDA_GRAPH_MODES, check_compile_mode

    assert CUDA_GRAPH_MODES == ("reduce-overhead",)
    with pytest.raises(ValueError, match="reduce-overhead.*on CUDA.*use 'default'"):
        check_compile_mode("reduce-overhead", torch.device("cuda"))
    check_compile_mode("default", "cuda")
    check_compile_mode("reduce-overhead", "cpu")
    if not torch.cuda.is_available():
        return
    cfg = SweepConfig(batches=(1,), seq_len=16, compile=True, compiled_only=True, compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="on CUDA"):
        run_sweep(tiny_qwen3.cuda(), tiny_qwen3, cfg)


def test_a_distill_step_with_bf16_working_weights_is_timed_on_a_copy(tiny_qwen3):
    """measure_distill(working_dtype="bfloat16"): the step the trainer runs with that setting (masters updated in
    float32) is timed on a copy; the caller's model keeps its float32 weights."""
    from hybrid.builders import from_teacher
    from research.perf.throughput import measure_distill

    student = from_teacher(tiny_qwen3)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    r = measure_distill(student, tiny_qwen3, 1, 16, steps=2, warmup=1, working_dtype="bfloat16")
    assert r["working_dtype"] == "bfloat16" and r["tokens_per_s"] > 0 and r["kind"] == "distill"
    for n, p in student.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), before[n]), n
    with pytest.raises(ValueError, match="working_dtype='fp8'"):
        measure_distill(student, tiny_qwen3, 1, 16, steps=1, warmup=0, working_dtype="fp8")


def test_a_compiling_sweep_raises_the_recompile_limit_while_it_runs(tiny_qwen3, monkeypatch):
    """The side runs compile one layer code for float32 and bf16 students and the teacher: at dynamo's default
    limit of 8 the H200's bf16 side run fell back to eager; the sweep raises it, and puts it back after."""
    import torch._dynamo

    import research.perf.throughput as tp
    from hybrid.builders import from_teacher
    from research.perf.sweep import RECOMPILE_LIMIT

    seen = []

    def fake(model, teacher, B, T, **kw):
        seen.append(torch._dynamo.config.recompile_limit)
        raise torch.OutOfMemoryError("fake: no step run")

    monkeypatch.setattr(tp, "measure_distill", fake)
    before = torch._dynamo.config.recompile_limit
    cfg = SweepConfig(batches=(1,), seq_len=16, steps=1, warmup=0, compile=True, compiled_only=True)
    with pytest.raises(RuntimeError, match="every batch size failed"):  # every (fake) side run ran out of memory
        run_sweep(from_teacher(tiny_qwen3), tiny_qwen3, cfg)
    assert len(seen) == 2 and all(s >= RECOMPILE_LIMIT for s in seen)  # the float32 and teacher side runs
    assert torch._dynamo.config.recompile_limit == before
