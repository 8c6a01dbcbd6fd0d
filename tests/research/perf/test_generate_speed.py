"""research.perf.generate_speed on the CPU with the shipped reference model: the rows and ratios it writes, and
its argument checks."""
from __future__ import annotations

import json

import pytest

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
        for path in ("fast", "eager", "teacher_dynamic", "teacher_static"):
            assert row[path]["tok_s"] > 0 and row[path]["step_ms"] >= 0, (path, row[path])
        assert row["bare_step_ms"] > 0 and row["fast_vs_eager"] > 0 and row["tok_s_fast_vs_eager"] > 0
    printed = capsys.readouterr().out
    assert "B=1: bare step" in printed and "fast/eager tok/s" in printed


@pytest.mark.parametrize("argv", [["--new", "1"], ["--batch", "0"], ["--prompt", "0"], ["--repeats", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        generate_speed.parse_args(argv)


@pytest.mark.skipif(not has_default_weights(), reason="the reference model's weights are not on disk")
def test_skipped_rows_are_left_out_and_their_ratios_are_null(tmp_path):
    out = tmp_path / "speed.json"
    assert generate_speed.main(["--prompt", "8", "--new", "3", "--batch", "1", "--repeats", "1",
                                "--skip", "eager,teacher_dynamic", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert "eager" not in row and "teacher_dynamic" not in row
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
