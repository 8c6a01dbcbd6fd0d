"""research.perf.time_split: kernels sorted into kinds by name, per layer, with the idle rest of the step."""
import json

import pytest

from research.perf import time_split


def test_kernel_names_fall_into_their_kinds():
    assert time_split.kind_of("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT") == "gemm"
    assert time_split.kind_of("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "gemm"
    assert time_split.kind_of("void cublasLt::splitKreduce_kernel<32, 16>") == "gemm"
    assert time_split.kind_of("split_kv") == time_split.kind_of("combine") == "attention"
    assert time_split.kind_of("step") == time_split.kind_of("fused_recurrent_gated_delta_rule_fwd_kernel") == "gdn"
    # an inductor kernel that names the decode attention among its fused sources is not the attention kernel
    assert time_split.kind_of("triton_per_fused__fused_rms_norm_decode_attention_mul_view_2") == "other"


def count_file(tmp_path, rows):
    path = tmp_path / "count.json"
    path.write_text(json.dumps(rows))
    return str(path)


def row(step, busy, times, layers=2, **extra):
    return {"total": 30, "per_layer": 15, "layers": layers, "step_us": step, "busy_us": busy,
            "time_by_name_us": times, **extra}


def test_a_timed_row_is_split_per_layer_and_untimed_rows_are_left_out(tmp_path, capsys):
    times = {"nvjet_a": 40.0, "split_kv": 20.0, "combine": 4.0, "step": 8.0, "triton_poi_fused_add_0": 8.0}
    path = count_file(tmp_path, {"hybrid_fused batch 1 compiled, graph": row(100.0, 80.0, times,
                                                                             per_layer_marginal=16),
                                 "hybrid_fused batch 1 compiled": row(900.0, 80.0, times),
                                 "teacher batch 1 eager": {"total": 80, "per_layer": 40, "layers": 2}})
    (r,) = time_split.main([path, "--markdown"])
    assert (r["step"], r["kernels"], r["idle"]) == (50.0, 40.0, 10.0)
    assert (r["gemm"], r["attention"], r["gdn"], r["other"]) == (20.0, 12.0, 4.0, 4.0)
    assert r["kernels_per_layer"] == 16
    out = capsys.readouterr().out
    assert ("| count.json | hybrid_fused batch 1 compiled, graph | 50.0 | 40.0 | 10.0 | 20.0 | 12.0 | 4.0 | 4.0 | 16 |"
            in out)
    assert len(time_split.main([path, "--all"])) == 2  # the unreplayed timed row too; the untimed one never


def test_a_file_without_times_is_refused_with_the_flag_that_adds_them(tmp_path):
    path = count_file(tmp_path, {"teacher batch 1 eager": {"total": 80, "per_layer": 40, "layers": 2}})
    with pytest.raises(SystemExit, match="--times"):
        time_split.main([path])
    with pytest.raises(SystemExit, match="cannot read"):
        time_split.main([str(tmp_path / "missing.json")])
