"""research/count_decode_ops.py: the models it counts and its CPU report."""
import argparse

import pytest
import torch

from hybrid.layers.hybrid_attention import GatedDeltaNetBranch
from research.count_decode_ops import build, cuda_rows, main, marginal, tiny_teacher


def test_build_gives_the_split_and_the_fused_hybrid_and_refuses_other_names():
    teacher = tiny_teacher(layers=2)
    split = [m.decode_backend for m in build(teacher, "hybrid").modules() if isinstance(m, GatedDeltaNetBranch)]
    fused = [m.decode_backend for m in build(teacher, "hybrid_fused").modules()
             if isinstance(m, GatedDeltaNetBranch)]
    assert split == ["split"] * 2 and fused == ["fused"] * 2  # one GDN branch per layer
    assert not any(isinstance(m, GatedDeltaNetBranch) for m in build(teacher, "teacher").modules())
    with pytest.raises(ValueError, match="hybrid_fused"):
        build(teacher, "hybrid_7to1")


def test_breaks_with_the_fused_op_list_it_as_one_graph_on_the_cpu(capsys):
    res = main(["--breaks", "--fused-gdn", "--batch", "1"])
    for name in ("teacher", "hybrid", "hybrid_fused"):
        assert (res[f"{name} graph breaks"]["graphs"], res[f"{name} graph breaks"]["breaks"]) == (1, 0)
    assert "== hybrid_fused: torch.compile of the step: 1 graphs, 0 breaks" in capsys.readouterr().out


def test_marginal_splits_one_layers_kernels_from_the_outside():
    # 2 layers: 2 x 20 + 9 outside = 49; 3 layers: 69 -> 20 a layer, 9 outside (per_layer would say 24.5)
    assert marginal(49, 69, 2) == {"per_layer_marginal": 20, "outside": 9}


def test_cuda_rows_count_the_compiled_rows_one_layer_deeper_too(monkeypatch, capsys):
    # a stand-in counter (the real one needs a GPU): 9 kernels outside the layers, 20 per layer when compiled
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    seen = []

    def counter(model, batch, context, compile, cuda_graph, compile_mode):
        layers = len(model.model.layers)
        seen.append((layers, compile, cuda_graph))
        per = 20 if compile else 40
        return {"total": 9 + per * layers, "per_layer": (9 + per * layers) / layers, "layers": layers, "memops": 0,
                "by_name": {"k": 9 + per * layers}}

    args = argparse.Namespace(compile=True, batch=[1], fused_gdn=False, context=16, compile_mode="default")
    res = cuda_rows(tiny_teacher(layers=2), args, deeper=tiny_teacher(layers=3), counter=counter)
    compiled = res["hybrid batch 1 compiled, graph"]
    assert (compiled["per_layer"], compiled["per_layer_marginal"], compiled["outside"]) == (24.5, 20, 9)
    assert "per_layer_marginal" not in res["teacher batch 1 eager"]  # eager rows have their per-layer scopes
    assert sorted(set(seen)) == [(2, False, False), (2, False, True), (2, True, False), (2, True, True),
                                 (3, True, False), (3, True, True)]
    assert "one more layer adds 20, 9 outside the layers" in capsys.readouterr().out


def test_bench_shape_counts_the_same_ops_per_layer_as_the_tiny_shape(capsys):
    """--shape bench: the benchmark's layer widths (GQA 16 / 8 heads of 128); on the CPU its aten ops per layer are
    the tiny model's (same structure, wider GEMMs); an unknown shape is refused with the list."""
    wide = tiny_teacher(layers=1, shape="bench")
    assert (wide.config.hidden_size, wide.config.num_attention_heads, wide.config.head_dim) == (2048, 16, 128)
    tiny = main(["--batch", "1", "--layers", "1"])
    bench = main(["--batch", "1", "--layers", "1", "--shape", "bench"])
    for name in ("teacher", "hybrid"):
        assert bench[f"{name} batch 1"]["per_layer_ops"] == tiny[f"{name} batch 1"]["per_layer_ops"]
    with pytest.raises(ValueError, match="tiny, bench"):
        tiny_teacher(shape="huge")


def test_times_pass_the_timed_steps_and_print_where_the_step_goes(monkeypatch, capsys):
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    seen = []

    def counter(model, batch, context, compile, cuda_graph, compile_mode, timed_steps=0):
        seen.append(timed_steps)
        return {"total": 10, "per_layer": 5, "layers": 2, "memops": 0, "by_name": {"k": 10}, "context": context,
                "busy_us": 30.0, "step_us": 40.0, "time_by_name_us": {"gemv_kernel": 20.0, "gdn": 10.0}}

    args = argparse.Namespace(compile=False, batch=[1], fused_gdn=False, context=32768, compile_mode="default",
                              times=50)
    cuda_rows(tiny_teacher(layers=2), args, counter=counter)
    assert set(seen) == {50}
    out = capsys.readouterr().out
    assert "time: 40.0 us a step at context 32768, kernels 30.0 us (75%), no kernel running 10.0 us" in out
    assert "gemv_kernel 20.0, gdn 10.0" in out


def test_inductor_settings_reach_the_compiled_rows_only(monkeypatch):
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    seen = []

    def counter(model, batch, context, compile, cuda_graph, compile_mode, compile_options=None):
        seen.append((compile, compile_options))
        return {"total": 10, "per_layer": 5, "layers": 2, "memops": 0, "by_name": {"k": 10}}

    args = argparse.Namespace(compile=True, batch=[1], fused_gdn=False, context=16, compile_mode="default",
                              compile_options={"combo_kernels": True}, pdl=False)
    res = cuda_rows(tiny_teacher(layers=2), args, counter=counter)
    assert {opts for comp, opts in [(c, str(o)) for c, o in seen] if comp} == {"{'combo_kernels': True}"}
    assert all(o is None for c, o in seen if not c)
    assert res["hybrid batch 1 compiled"]["compile_options"] == {"combo_kernels": True}
    assert "compile_options" not in res["hybrid batch 1 eager"]


@pytest.mark.parametrize("argv, message", [
    (["--inductor", "combo_kernels=true"], "add --compile"),
    (["--compile", "--inductor", "combo_kernel=true"], "not torch._inductor.config settings"),
    (["--compile", "--inductor", "combo_kernels"], "give KEY=VALUE"),
])
def test_bad_inductor_settings_are_refused_before_any_model_is_built(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_teacher_has_the_positions_of_the_context_it_is_counted_at():
    assert tiny_teacher(layers=1, shape="tiny", positions=40000).config.max_position_embeddings == 40000


@pytest.mark.parametrize("job", ["decode_time_split", "decode_time_split_pdl", "decode_combo_count"])
def test_the_count_jobs_args_are_accepted(job, monkeypatch):
    """The jobs' args pass the script's parser and checks (a stand-in stops it where the model would be built)."""
    import research.count_decode_ops as script
    from research.launch import get_job

    class Built(Exception):
        pass

    def stop(**kw):
        raise Built
    monkeypatch.setattr(script, "tiny_teacher", stop)
    with pytest.raises(Built):
        script.main([str(a) for a in get_job(job).args])


def test_the_combo_jobs_differ_from_their_baselines_in_the_inductor_flag_alone():
    from research.launch import get_job

    best = get_job("bench_decode_best").args
    assert list(get_job("bench_decode_combo").args) == [*best, "--inductor", "combo_kernels=true"]
    assert list(get_job("bench_decode_pdl").args) == [*best, "--pdl"]
    best_128k = get_job("bench_decode_best_128k").args
    at_128k = [("131072" if a == "32768" else "200" if a == "400" else a) for a in best]
    assert list(best_128k) == at_128k and list(get_job("bench_decode_pdl_128k").args) == [*best_128k, "--pdl"]
    split, count = get_job("decode_time_split").args, get_job("decode_combo_count").args
    assert "--inductor" not in split and list(count[-2:]) == ["--inductor", "combo_kernels=true"]
    assert list(get_job("decode_time_split_pdl").args) == [*split, "--pdl"]
    assert list(get_job("decode_time_split_gemv").args) == [*split, "--gemv"]
    assert list(get_job("bench_decode_gemv").args) == [*best, "--gemv"]
    assert list(get_job("bench_decode_gemv_128k").args) == [*best_128k, "--gemv"]


def test_pdl_reaches_every_counted_step(monkeypatch):
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    seen = []

    def counter(model, batch, context, compile, cuda_graph, compile_mode, pdl=False):
        seen.append(pdl)
        return {"total": 10, "per_layer": 5, "layers": 2, "memops": 0, "by_name": {"k": 10}}

    args = argparse.Namespace(compile=True, batch=[1], fused_gdn=False, context=16, compile_mode="default", pdl=True)
    res = cuda_rows(tiny_teacher(layers=2), args, counter=counter)
    assert seen and all(seen) and all(r["pdl"] for r in res.values())


def test_gemv_switches_every_counted_model_and_is_recorded(monkeypatch):
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    seen = []

    def counter(model, batch, context, compile, cuda_graph, compile_mode, **kw):
        seen.append(all(getattr(m, "decode_gemv", False) for m in model.modules() if isinstance(m, torch.nn.Linear)))
        return {"total": 10, "per_layer": 5, "layers": 2, "memops": 0, "by_name": {"k": 10}}

    args = argparse.Namespace(compile=False, batch=[1], fused_gdn=False, context=16, compile_mode="default",
                              gemv=True)
    res = cuda_rows(tiny_teacher(layers=2), args, counter=counter)
    assert seen and all(seen) and all(r["gemv"] for r in res.values())
