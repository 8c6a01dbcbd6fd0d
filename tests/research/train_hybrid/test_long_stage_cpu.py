"""research/train_hybrid/long_stage_cpu.py at a micro setting: stages 1-2 once, two stage-3 variants (a "long"
one and the "distill" one) resumed from the same stage-2 checkpoint, every number in the JSON finite."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def load_script():
    spec = importlib.util.spec_from_file_location("long_stage_cpu", ROOT / "research/train_hybrid/long_stage_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_long_stage_variants_from_one_stage2_checkpoint(tmp_path):
    from headscope.mask import HeadMask
    from headscope.reference import load_model

    teacher, _ = load_model("default")
    HeadMask.for_model(teacher, [(1, 6), (1, 7), (3, 2), (3, 3)]).to_json(tmp_path / "mask.json")
    args = ["--mask", str(tmp_path / "mask.json"), "--out", str(tmp_path / "o"), "--corpus", "heldout",
            "--haystack", "heldout", "--short", "32", "--batch", "4", "--align-steps", "2", "--distill-steps", "2",
            "--long-steps", "2", "--teacher-samples", "2", "--teacher-sample-len", "16", "--eval-windows", "2",
            "--niah-n", "2", "--threads", "1", "--variants", "reference,distill_kl"]
    out = load_script().main(args)
    assert json.loads((tmp_path / "o" / "results.json").read_text()) == json.loads(json.dumps(out, default=str))
    keys = {"loss@32", "loss@128", "niah@128"}
    assert set(out["variants"]) == {"reference", "distill_kl"}
    for row in [out["teacher"], out["stage2"], *out["variants"].values()]:
        assert keys <= set(row)
        assert all(math.isfinite(row[k]) for k in keys)
        assert 0.0 <= row["niah@128"] <= 1.0
    assert out["variants"]["reference"]["stage3"]["name"] == "long"
    assert out["variants"]["distill_kl"]["stage3"]["name"] == "distill"
    assert out["variants"]["reference"]["stage3"]["seq_len"] == 128 and out["variants"]["reference"]["stage3"]["batch_size"] == 1
    # each variant continued from the stage-2 checkpoint: its log resumes at stage 3, step 0
    for name in out["variants"]:
        log = [json.loads(line) for line in (tmp_path / "o" / f"v-{name}" / "log.jsonl").read_text().splitlines()]
        resume = next(r for r in log if r.get("event") == "resume")
        assert resume["stage_index"] == 2 and resume["step"] == 0
        assert not any(r.get("stage_index") in (0, 1) and "loss" in r for r in log)
        assert (tmp_path / "o" / f"v-{name}" / "hybrid" / "config.json").exists()
