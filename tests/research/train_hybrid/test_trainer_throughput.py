"""research/train_hybrid/trainer_throughput.py: the trainer's own tokens/s and MFU per stage, from its log."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_factories import reference_kv_group_mask

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "research" / "train_hybrid" / "trainer_throughput.py"


def test_tiny_run_reports_tokens_per_second_and_mfu_per_stage(tmp_path):
    from headscope.reference import load_model
    from hybrid import from_mask
    from research.perf.throughput import H200_BF16_PEAK, forward_flops_per_token

    mask = reference_kv_group_mask(tmp_path / "mask.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--config", str(ROOT / "research/train_hybrid/tiny.toml"),
                        "--mask", str(mask), "--out", str(tmp_path / "o")], env=env, cwd=ROOT, capture_output=True,
                       text=True, check=True)
    rows = {r["stage"]: r for r in json.loads((tmp_path / "o" / "trainer_throughput.json").read_text())["rows"]}
    assert set(rows) == {"align", "distill", "long"}
    for r in rows.values():  # tiny.toml logs every step: every step after the first (compiling) one is a record
        assert r["tok_per_s_min"] <= r["tok_per_s_median"] <= r["tok_per_s_max"] and r["tok_per_s_median"] > 0
    assert rows["align"]["mfu"] is None and "MFU not counted" in p.stdout  # only the new parameters train
    d, lg = rows["distill"], rows["long"]  # distill: student x 3 + the teacher's forward; long: student x 3
    teacher, _ = load_model()
    student = from_mask(teacher, mask, gdn_fold_heads=True)  # tiny.toml's hybrid options
    assert d["model_flops_per_token"] == pytest.approx(3 * forward_flops_per_token(student, d["seq_len"])
                                                       + forward_flops_per_token(teacher, d["seq_len"]))
    assert lg["model_flops_per_token"] == pytest.approx(3 * forward_flops_per_token(student, lg["seq_len"]))
    assert d["mfu"] == pytest.approx(d["tok_per_s_median"] * d["model_flops_per_token"] / H200_BF16_PEAK, rel=1e-3)
    assert lg["mfu"] == pytest.approx(lg["tok_per_s_median"] * lg["model_flops_per_token"] / H200_BF16_PEAK,
                                      rel=1e-3)
    assert f"distill: batch {d['batch_size']} x {d['seq_len']}" in p.stdout and "MFU" in p.stdout


def test_a_repeated_stage_name_is_read_by_its_place(tmp_path):
    """Two "align" stages at batch 1 and 2 (as smollm2_stage1_speed.toml has at 16 and 64): a row each, in order."""
    text = (ROOT / "research/train_hybrid/tiny.toml").read_text()
    head = text[:text.index("[[stages]]")]
    stages = "".join(f'[[stages]]\nname = "align"\nsteps = 3\nlr = 2e-3\nseq_len = 64\nbatch_size = {b}\n\n'
                     for b in (1, 2))
    (tmp_path / "two.toml").write_text(head + stages)
    mask = reference_kv_group_mask(tmp_path / "mask.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--config", str(tmp_path / "two.toml"), "--mask", str(mask),
                        "--out", str(tmp_path / "o")], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    rows = json.loads((tmp_path / "o" / "trainer_throughput.json").read_text())["rows"]
    assert [(r["stage"], r["stage_index"], r["batch_size"]) for r in rows] == [("align", 0, 1), ("align", 1, 2)]
    assert [r["log_records"] for r in rows] == [3, 3]  # log_every 1: each stage its own 3 records, not both's 6
    assert "align (schedule entry 1): batch 1 x 64" in p.stdout and "align (schedule entry 2): batch 2 x 64" in p.stdout


def test_a_stage_that_runs_out_of_memory_leaves_the_earlier_stages_read(tmp_path, monkeypatch, capsys):
    """A size sweep's last stage out of memory (as one pass of 64 rows on an 80 GB GPU): the stages before it are
    still reported, and the file says what ran out."""
    import torch

    from hybrid.train import trainer as trainer_mod
    from research.train_hybrid import trainer_throughput

    real = trainer_mod.Trainer.train_stage

    def third_out_of_memory(self, index, s, start, train_state):
        if index == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(self, index, s, start, train_state)

    monkeypatch.setattr(trainer_mod.Trainer, "train_stage", third_out_of_memory)
    mask = reference_kv_group_mask(tmp_path / "mask.json")
    assert trainer_throughput.main(["--config", str(ROOT / "research/train_hybrid/tiny.toml"), "--mask", str(mask),
                                    "--out", str(tmp_path / "o")]) == 0
    out = json.loads((tmp_path / "o" / "trainer_throughput.json").read_text())
    assert [r["stage"] for r in out["rows"]] == ["align", "distill"]
    assert out["out_of_memory"].startswith("CUDA out of memory")
    assert "long: no log records with tokens/s (it ran out of memory" in capsys.readouterr().out
