"""research.perf.generate_speed on the CPU with the shipped reference model: the rows and ratios it writes, and
its argument checks."""
from __future__ import annotations

import json

import pytest
import torch

from headscope.reference import has_default_weights
from research.perf import generate_speed

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.skipif(not has_default_weights(), reason="the reference model's weights are not on disk")
def test_generate_speed_writes_fast_eager_and_teacher_rows(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert generate_speed.main(["--prompt", "8", "--new", "3", "--batch", "1,2", "--repeats", "1",
                                "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["model"] == "default" and data["mask"].endswith("reference_mask_7to1.json")
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    for row in data["rows"]:
        for path in ("fast", "eager", "teacher_dynamic", "teacher_static", "teacher_engine"):
            assert row[path]["tok_s"] > 0 and row[path]["step_ms"] >= 0, (path, row[path])
        assert row["bare_step_ms"] > 0 and row["fast_vs_eager"] > 0 and row["tok_s_fast_vs_eager"] > 0
        # the hybrid against the fastest of the teacher's three generate() paths
        best = max(("teacher_dynamic", "teacher_static", "teacher_engine"), key=lambda k: row[k]["tok_s"])
        assert row["best_teacher"] == best
        assert row["fast_vs_best_teacher"] == pytest.approx(row["fast"]["tok_s"] / row[best]["tok_s"], rel=1e-2)
    printed = capsys.readouterr().out
    assert "B=1: bare step" in printed and "fast/eager tok/s" in printed and "teacher_engine" in printed


@pytest.mark.parametrize("argv", [["--new", "1"], ["--batch", "0"], ["--prompt", "0"], ["--repeats", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        generate_speed.parse_args(argv)


@pytest.mark.skipif(not has_default_weights(), reason="the reference model's weights are not on disk")
def test_skipped_rows_are_left_out_and_their_ratios_are_null(tmp_path):
    out = tmp_path / "speed.json"
    assert generate_speed.main(["--prompt", "8", "--new", "3", "--batch", "1", "--repeats", "1",
                                "--skip", "eager,teacher_dynamic,teacher_engine", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert "eager" not in row and "teacher_dynamic" not in row and "teacher_engine" not in row
    assert row["best_teacher"] == "teacher_static"
    assert row["fast"]["tok_s"] > 0 and row["teacher_static"]["tok_s"] > 0
    assert row["fast_vs_eager"] is None and row["tok_s_fast_vs_eager"] is None
    assert row["teacher_static_vs_fast"] > 0


def test_an_unknown_skip_is_named():
    with pytest.raises(SystemExit):
        generate_speed.parse_args(["--skip", "fast"])


@pytest.mark.skipif(not has_default_weights(), reason="the reference model's weights are not on disk")
def test_fused_gdn_adds_its_rows_and_switches_the_model_back(tmp_path, capsys, monkeypatch):
    """--fused-gdn times the fast path again with every GDN branch on the fused decode op, then restores the split
    path (the eager and teacher rows after it run as before)."""
    from hybrid.layers.hybrid_attention import GatedDeltaNetBranch

    seen = []
    real = generate_speed.generate_row

    def spy(model, *a, **kw):
        seen.append({m.decode_backend for m in model.modules() if isinstance(m, GatedDeltaNetBranch)})
        return real(model, *a, **kw)

    monkeypatch.setattr(generate_speed, "generate_row", spy)
    out = tmp_path / "speed.json"
    assert generate_speed.main(["--prompt", "8", "--new", "3", "--batch", "1", "--repeats", "1", "--fused-gdn",
                                "--skip", "teacher_dynamic,teacher_static", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["fast_fused_gdn"]["tok_s"] > 0 and row["bare_step_fused_gdn_ms"] > 0
    assert seen[:3] == [{"split"}, {"fused"}, {"split"}]  # fast, fast_fused_gdn, eager
    assert "fast_fused_gdn" in capsys.readouterr().out


@pytest.mark.skipif(not has_default_weights(), reason="the reference model's weights are not on disk")
def test_a_saved_hybrid_past_the_teachers_prompt_and_both_caches_bytes(tmp_path, capsys):
    """--hybrid times a saved hybrid (here the untrained 7:1 one, saved), --teacher-prompt gives the teacher its own
    prompt length, and every row records both decode caches' bytes as hybrid.cache counts them."""
    import headscope
    import hybrid
    from hybrid.cache import cache_nbytes, teacher_cache_nbytes

    teacher, _ = headscope.load_model("default")
    saved = tmp_path / "hybrid"
    hybrid.save(hybrid.from_mask(teacher, str(generate_speed.SHIPPED_MASKS["default"])), saved)
    out = tmp_path / "speed.json"
    assert generate_speed.main(["--hybrid", str(saved), "--prompt", "16", "--teacher-prompt", "8", "--new", "3",
                                "--batch", "2", "--repeats", "1", "--skip", "eager,teacher_dynamic",
                                "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    row = data["rows"][0]
    assert data["mask"] == f"saved hybrid {saved}" and (data["prompt"], data["teacher_prompt"]) == (16, 8)
    assert row["cache_bytes"] == cache_nbytes(hybrid.load(saved), 16 + 3, 2, torch.float32)["total"]
    assert row["teacher_cache_bytes"] == teacher_cache_nbytes(teacher, 8 + 3, 2, torch.float32)
    assert row["cache_vs_teacher"] == pytest.approx(row["cache_bytes"] / row["teacher_cache_bytes"], abs=1e-4)
    assert row["fast"]["tok_s"] > 0 and row["teacher_static"]["tok_s"] > 0
    assert "MiB (teacher" in capsys.readouterr().out


def test_a_missing_saved_hybrid_or_both_sources_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        generate_speed.parse_args(["--hybrid", str(tmp_path)])
    assert "no saved hybrid there" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        generate_speed.parse_args(["--hybrid", str(tmp_path), "--mask", "m.json"])
    assert "not both" in capsys.readouterr().err


@pytest.mark.skipif(not has_default_weights(), reason="the reference model's weights are not on disk")
def test_cache_only_counts_bytes_and_times_nothing(tmp_path, monkeypatch, capsys):
    from hybrid.cache import teacher_cache_nbytes

    monkeypatch.setattr(generate_speed, "generate_row", lambda *a, **k: pytest.fail("--cache-only timed a row"))
    out = tmp_path / "cache.json"
    assert generate_speed.main(["--prompt", "4096", "--teacher-prompt", "2048", "--new", "128", "--batch", "1,2",
                                "--dtype", "bfloat16", "--cache-only", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and set(rows[0]) == {"batch", "cache_bytes", "teacher_cache_bytes",
                                                                     "cache_vs_teacher"}
    assert rows[1]["cache_bytes"] == 2 * rows[0]["cache_bytes"]
    import headscope

    teacher, _ = headscope.load_model("default")
    assert rows[0]["teacher_cache_bytes"] == teacher_cache_nbytes(teacher, 2048 + 128, 1, torch.bfloat16)
    assert rows[0]["cache_bytes"] < rows[0]["teacher_cache_bytes"]  # 1/8 of the KV at twice the positions + states
    assert "hybrid / teacher" in capsys.readouterr().out


@pytest.mark.skipif(not has_default_weights(), reason="the reference model's weights are not on disk")
def test_pdl_adds_its_row_through_generate(tmp_path, capsys, monkeypatch):
    """--pdl times the fast path again with generate(pdl_decode=True) (on the CPU the same path: nothing to launch
    early), after the rows without it."""
    seen = []
    real = generate_speed.generate_row

    def spy(model, *a, **kw):
        seen.append(kw.get("pdl_decode"))
        return real(model, *a, **kw)

    monkeypatch.setattr(generate_speed, "generate_row", spy)
    out = tmp_path / "speed.json"
    assert generate_speed.main(["--prompt", "8", "--new", "3", "--batch", "1", "--repeats", "1", "--pdl",
                                "--skip", "eager,teacher_dynamic,teacher_static,teacher_engine", "--out",
                                str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["fast_pdl"]["tok_s"] > 0 and seen == [None, True]
    assert "fast_pdl" in capsys.readouterr().out
