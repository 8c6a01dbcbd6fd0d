"""research/train_hybrid/backend_parity.py on the CPU: every backend is a PyTorch twin here, so float32 'auto'
equals float32 'twins' exactly and bf16 autocast moves the logits a little (the GPU call compares the kernels)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]


def load_script():
    spec = importlib.util.spec_from_file_location("backend_parity", ROOT / "research/train_hybrid/backend_parity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_backend_parity_rows_on_cpu(tmp_path):
    import hybrid
    from headscope.mask import HeadMask
    from headscope.reference import load_model

    teacher, tok = load_model("default")
    model = hybrid.from_mask(teacher, HeadMask.for_model(teacher, [(1, 6), (1, 7), (3, 2), (3, 3)]))
    model.save_pretrained(tmp_path / "h")
    tok.save_pretrained(tmp_path / "h")
    out = load_script().main(["--model", str(tmp_path / "h"), "--length", "64", "--samples", "2",
                              "--out", str(tmp_path / "p.json")])
    rows = {(r["precision"], r["backends"]): r for r in out["rows"]}
    assert set(rows) == {("fp32", "twins"), ("fp32", "auto"), ("bf16_autocast", "twins"), ("bf16_autocast", "auto")}
    assert rows["fp32", "auto"]["max_abs_logit_diff_vs_fp32_twins"] == 0.0
    assert rows["fp32", "auto"]["heldout_loss"] == rows["fp32", "twins"]["heldout_loss"]
    assert 0 < rows["bf16_autocast", "twins"]["max_abs_logit_diff_vs_fp32_twins"] < 1.0
    bf = rows["bf16_autocast", "twins"]  # where the largest difference is, and how the rest compares
    assert 0 <= bf["max_diff_at_row_position"][0] < 2 and 0 <= bf["max_diff_at_row_position"][1] < 64
    assert 0 < bf["mean_abs_logit_diff"] <= bf["max_abs_logit_diff_vs_fp32_twins"] and bf["max_abs_ref_logit_there"] > 0
    assert json.loads((tmp_path / "p.json").read_text())["rows"] == out["rows"]
    assert torch.isfinite(torch.tensor([r["heldout_loss"] for r in out["rows"]])).all()
