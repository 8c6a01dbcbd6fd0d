"""experiments/reference/train_reference.py is a thin caller of hybrid.train ("pretrain" stage)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REF = Path(__file__).resolve().parents[3] / "experiments" / "reference" / "train_reference.py"


def load_script():
    spec = importlib.util.spec_from_file_location("_train_reference", REF)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_cpu_run_trains_and_saves_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from hybrid.train.logs import read_log

    script = load_script()
    out = tmp_path / "ref"
    script.main(["--out", str(out), "--device", "cpu", "--tiny", "--max-steps", "6", "--corpus", "heldout",
                 "--seq-len", "64", "--min-len", "32", "--tokens-per-batch", "256", "--probe-n", "2",
                 "--probe-every", "6", "--log-every", "1", "--head-drop", "0.05", "--no-progress"])
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["step"] == 6 and "eval_acc_reasoning" in summary
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 3 and model.config.hidden_size == 128
    recs = [r for r in read_log(out / "log.jsonl") if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, 7)) and {r["seq_len"] for r in recs} <= {32, 64}
    assert recs[-1]["loss"] < recs[0]["loss"]
