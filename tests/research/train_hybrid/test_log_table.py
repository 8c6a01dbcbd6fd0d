"""research.train_hybrid.log_table: two training logs side by side per stage, the second's tokens/s as a ratio to the
first's; on the committed H100 logs of the CE-only and the long_distill stage 3 (the second cut off in stage 3b)."""
from __future__ import annotations

from pathlib import Path

import pytest

from research.train_hybrid import log_table

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"
CE = RESULTS / "2026-12-07_smollm2_long_rope_part_h100_seed0" / "train_log.jsonl"
KL = RESULTS / "2026-12-07_smollm2_long_distill_stage3_cost_h100" / "train_log.jsonl"


def test_the_table_reads_each_stage_and_the_ratio_to_the_first_run(tmp_path, capsys):
    rows = log_table.table([("ce", CE), ("long_distill", KL)])
    by = {(r["run"], r["stage_index"]): r for r in rows}
    assert len(rows) == 8
    assert [by[("long_distill", i)]["stage"] for i in range(4)] == ["align", "distill", "long_distill", "long_distill"]
    assert (by[("ce", 2)]["steps"], by[("ce", 2)]["capped"]) == (415, True)
    assert (by[("long_distill", 2)]["steps"], by[("long_distill", 2)]["capped"]) == (288, True)
    assert (by[("long_distill", 3)]["steps"], by[("long_distill", 3)]["capped"]) == (150, False)  # cut off
    assert by[("ce", 1)]["loss_kl"] == pytest.approx(0.1377, abs=1e-4)
    assert by[("long_distill", 1)]["loss_kl"] == pytest.approx(0.1384, abs=1e-4)
    assert [by[("long_distill", i)]["tok_per_s_ratio"] for i in range(4)] == [0.774, 0.874, 0.678, 0.79]
    assert all(by[("ce", i)]["tok_per_s_ratio"] == 1.0 for i in range(4))
    assert (by[("long_distill", 2)]["gpu_mem_gib"], by[("ce", 2)]["gpu_mem_gib"]) == (49.39, 43.39)
    assert by[("long_distill", 0)]["first_step_s"] == pytest.approx(132.97)
    assert log_table.main([f"ce={CE}", f"long_distill={KL}", "--out", str(tmp_path / "t.csv")]) == 0
    assert "long_distill | 2 | long_distill | 288 | True" in capsys.readouterr().out
    assert (tmp_path / "t.csv").read_text().splitlines()[0] == ",".join(log_table.COLUMNS)


def test_a_bad_argument_names_the_form(tmp_path, capsys):
    with pytest.raises(SystemExit):
        log_table.main([str(tmp_path / "missing.jsonl")])
    assert "give NAME=LOG" in capsys.readouterr().err
