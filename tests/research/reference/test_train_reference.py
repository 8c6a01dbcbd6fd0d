"""research/reference/train_reference.py is a thin caller of hybrid.train ("pretrain" stage)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
REF = ROOT / "research" / "reference" / "train_reference.py"


def run_script(*args: str) -> None:
    """The script as a user runs it (a process of its own; tests never import scripts by path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(REF), *args], check=True, env=env, cwd=ROOT)


def test_tiny_cpu_run_trains_and_saves_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from hybrid.train.logs import read_log

    out = tmp_path / "ref"
    run_script("--out", str(out), "--device", "cpu", "--tiny", "--max-steps", "6", "--corpus", "heldout",
               "--seq-len", "64", "--min-len", "32", "--tokens-per-batch", "256", "--probe-n", "2",
               "--probe-every", "6", "--log-every", "1", "--head-drop", "0.05", "--no-progress")
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["step"] == 6 and "eval_acc_reasoning" in summary
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 3 and model.config.hidden_size == 128
    recs = [r for r in read_log(out / "log.jsonl") if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, 7)) and {r["seq_len"] for r in recs} <= {32, 64}
    assert recs[-1]["loss"] < recs[0]["loss"]
