"""research.perf.decode_table: means and spreads over runs, ratios against the faster teacher path, the floor."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from research.perf import decode_table

SHAPE_CACHE = [dict(model="teacher", context=1024, fa_kv_bytes=1000, gdn_state_bytes=0),
               dict(model="hybrid_7to1", context=1024, fa_kv_bytes=125, gdn_state_bytes=10)]


def bench(tmp_path, name, teacher_graph, hybrid_graph, teacher_compiled=None, fused=None, compiled_fused=None):
    t = dict(model="teacher", context=2048, batch=2, graph_ms=teacher_graph)
    h = dict(model="hybrid_7to1", context=2048, batch=2, graph_ms=hybrid_graph)
    if teacher_compiled:
        t["compiled_ms"] = teacher_compiled
    if fused:
        h["fused_gdn_ms"] = fused
    if compiled_fused:
        h["compiled_fused_ms"] = compiled_fused
    path = tmp_path / name
    path.write_text(json.dumps(dict(decode=[t, h], cache_bytes=SHAPE_CACHE,
                                    params=dict(teacher=500, hybrid_7to1=600))))
    return str(path)


def test_means_spreads_best_teacher_and_floor(tmp_path, capsys):
    runs = [bench(tmp_path, "a.json", 10.0, 4.0, fused=3.0), bench(tmp_path, "b.json", 12.0, 6.0, 8.0, fused=3.0)]
    rows = decode_table.summarize(decode_table.load(runs), bandwidth=1e6)
    teacher, hybrid = rows
    assert teacher["model"] == "teacher" and teacher["graph_ms"] == 11.0 and teacher["graph_spread"] == 2.0
    assert teacher["teacher_best_ms"] == 8.0 and teacher["teacher_best_path"] == "compiled"  # faster than 11
    assert hybrid["graph_ms"] == 5.0 and hybrid["graph_speedup"] == pytest.approx(8.0 / 5.0)
    assert hybrid["fused_gdn_speedup"] == pytest.approx(8.0 / 3.0) and hybrid["fused_gdn_runs"] == 2
    # floor: 2 bytes per parameter + 2 rows x (FA bytes at 2048 = 2 x 125, + 10 of state), at 1e6 bytes/s
    assert hybrid["floor_ms"] == pytest.approx((2 * 600 + 2 * (250 + 10)) / 1e6 * 1e3)
    assert decode_table.main(runs + ["--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| 2K, 2 | hybrid_7to1 | 5.00 ± 1.00 (1.60x) | 3.00 ± 0.00 (2.67x) | - |" in out
    assert "not measured" in out  # no 128K / 32K rows in these runs


def test_dry_runs_and_missing_files_are_refused_with_the_fix(tmp_path):
    dry = tmp_path / "dry.json"
    dry.write_text(json.dumps(dict(dry_run=True, decode=[{}])))
    with pytest.raises(SystemExit, match="CPU dry run"):
        decode_table.load([str(dry)])
    with pytest.raises(SystemExit, match="cannot read"):
        decode_table.load([str(tmp_path / "missing.json")])
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(dict(decode=[])))
    with pytest.raises(SystemExit, match="--sections decode"):
        decode_table.load([str(empty)])


def test_the_compiled_fused_path_is_a_column_and_can_be_the_best(tmp_path, capsys):
    """compiled_fused_ms (the fused GDN op inside the compiled step) is summarized like the other paths, has its
    markdown column, and counts for the verdict's best path."""
    runs = [bench(tmp_path, "a.json", 10.0, 4.0, 9.0, fused=3.0, compiled_fused=2.0)]
    hybrid = decode_table.summarize(decode_table.load(runs), bandwidth=1e6)[1]
    assert hybrid["compiled_fused_ms"] == 2.0 and hybrid["compiled_fused_speedup"] == pytest.approx(9.0 / 2.0)
    assert decode_table.main(runs + ["--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| 2K, 2 | hybrid_7to1 | 4.00 (2.25x) | 3.00 (3.00x) | - | 2.00 (4.50x) |" in out
    assert "(compiled_fused)" in out  # best / floor names the path


def test_the_teachers_transformers_step_can_be_its_best(tmp_path):
    """hf_static_ms (the teacher on transformers' own compiled static cache) is one of the teacher's paths: the
    faster of all its paths is the base of every hybrid ratio."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(dict(decode=[dict(model="teacher", context=2048, batch=2, graph_ms=10.0, compiled_ms=9.0,
                                                 hf_static_ms=7.0),
                                            dict(model="hybrid_7to1", context=2048, batch=2, graph_ms=3.5)],
                                    cache_bytes=SHAPE_CACHE, params=dict(teacher=500, hybrid_7to1=600))))
    teacher, hybrid = decode_table.summarize(decode_table.load([str(path)]), bandwidth=1e6)
    assert (teacher["teacher_best_ms"], teacher["teacher_best_path"]) == (7.0, "hf_static")
    assert hybrid["graph_speedup"] == pytest.approx(2.0)


def test_kernels_per_layer_column_prefers_one_layers_count_and_the_fused_op(tmp_path, capsys):
    runs = [bench(tmp_path, "a.json", 10.0, 4.0, compiled_fused=3.0)]
    count = {"teacher batch 2 compiled, graph": {"per_layer": 15.5, "per_layer_marginal": 13},
             "hybrid batch 2 compiled, graph": {"per_layer": 24.5},
             "hybrid_fused batch 2 compiled, graph": {"per_layer": 22.0, "per_layer_marginal": 19}}
    assert decode_table.kernels_per_layer(count, "teacher", 2) == "13"
    assert decode_table.kernels_per_layer(count, "hybrid_7to1", 2) == "19"  # the fused op's, one layer's own
    split_only = {k: v for k, v in count.items() if not k.startswith("hybrid_fused")}
    assert decode_table.kernels_per_layer(split_only, "hybrid_7to1", 2) == "24.5* (split GDN)"
    assert decode_table.kernels_per_layer(count, "layer_3to1", 2) is None  # not counted
    path = tmp_path / "count.json"
    path.write_text(json.dumps(split_only))
    assert decode_table.main(runs + ["--kernels", str(path), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("| compiled kernels / layer |")
    assert "| 13 |" in out and "| 24.5* (split GDN) |" in out and "\\* the tiny count model's" in out


def test_a_count_without_gpu_rows_is_refused_with_the_command(tmp_path):
    runs = [bench(tmp_path, "a.json", 10.0, 4.0)]
    path = tmp_path / "count.json"
    path.write_text(json.dumps({"teacher batch 1": {"per_layer": 30}}))  # a CPU count: aten ops, not kernels
    with pytest.raises(SystemExit, match="--device cuda --compile"):
        decode_table.main(runs + ["--kernels", str(path)])


def test_runs_of_different_settings_are_refused_and_the_setting_is_printed(tmp_path, capsys):
    runs = [bench(tmp_path, "a.json", 10.0, 4.0), bench(tmp_path, "b.json", 10.0, 3.0)]
    data = json.loads(Path(runs[1]).read_text())
    data.update(pdl=True, pdl_used=True, compile_options={"combo_kernels": True})
    Path(runs[1]).write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="differ in their setting") as e:
        decode_table.main(runs)
    assert "b.json: GPU not recorded, compile mode default, inductor" in str(e.value) and "PDL" in str(e.value)
    assert decode_table.main(runs[1:]) == 0
    assert '1 run(s): GPU not recorded, compile mode default, inductor {"combo_kernels": true}, PDL' in \
        capsys.readouterr().out


def test_runs_with_and_without_the_decode_gemv_are_different_settings(tmp_path, capsys):
    runs = [bench(tmp_path, "a.json", 10.0, 4.0), bench(tmp_path, "b.json", 10.0, 3.0)]
    data = json.loads(Path(runs[1]).read_text())
    data.update(gemv=True)
    Path(runs[1]).write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="differ in their setting") as e:
        decode_table.main(runs)
    assert "b.json: GPU not recorded, compile mode default, decode GEMV" in str(e.value)
    assert decode_table.main(runs[1:]) == 0 and "decode GEMV" in capsys.readouterr().out
