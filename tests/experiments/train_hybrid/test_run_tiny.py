"""experiments/train_hybrid/run.py --tiny: the whole GPU pipeline on CPU (mask given, or selected: slow)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "experiments" / "train_hybrid" / "run.py"


def run_script(*args: str) -> dict:
    """The script in a process of its own (tests never import scripts by path); returns its results.json."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, env=env, cwd=ROOT)
    out = Path(args[args.index("--out") + 1])
    return json.loads((out / "results.json").read_text())


def kv_group_mask(path: Path) -> Path:
    """FA on KV groups (L0, kv0), (L1, kv3), (L4, kv1), (L6, kv2) of the reference model: 1/8 of its KV heads."""
    from headscope.heads import Head
    from headscope.mask import HeadMask
    from headscope.reference import load_model

    model, _ = load_model()
    heads = [Head(l, 2 * g + r) for l, g in ((0, 0), (1, 3), (4, 1), (6, 2)) for r in range(2)]
    HeadMask.for_model(model, heads).to_json(path)
    return path


def check(out: dict, folder: Path) -> None:
    assert out["mask"]["kv_cache_fraction"] == pytest.approx(1 / 8)
    table = out["eval"]["table"]
    assert {"niah@128", "multikey@128", "ppl@128", "niah@256", "niah@512", "niah@1024"} <= set(table)
    assert {k for k in table if k.startswith("reasoning_")} == {"reasoning_arithmetic", "reasoning_binding",
                                                                 "reasoning_comparison", "reasoning_two_hop"}
    assert all({"teacher", "hybrid"} <= set(row) for row in table.values())
    assert set(out["train"]["minutes_by_stage"]) == {"align", "distill", "long"}
    assert out["throughput"]["distill"]["tokens_per_s"] > 0 and out["throughput"]["distill"]["model_flops_per_token"] > 0
    assert json.loads((folder / "results.json").read_text())["schema"] == "hybrid.train.experiment"
    assert (folder / "run" / "hybrid" / "config.json").exists() and (folder / "run" / "training.html").exists()


def test_tiny_pipeline_with_a_given_mask(tmp_path):
    mask = kv_group_mask(tmp_path / "mask.json")
    out = run_script("--config", str(ROOT / "experiments/train_hybrid/tiny.toml"), "--out", str(tmp_path / "o"),
                     "--tiny", "--mask", str(mask), "--n", "1")
    check(out, tmp_path / "o")
    assert out["train"]["minutes_from"] == "wall clock of the training"
    # a run trained elsewhere (the GPU) and brought back is evaluated without training again
    (tmp_path / "o" / "results.json").unlink()
    again = run_script("--config", str(ROOT / "experiments/train_hybrid/tiny.toml"), "--out", str(tmp_path / "o"),
                       "--tiny", "--mask", str(mask), "--n", "1", "--eval-only", "--no-throughput")
    assert again["train"]["minutes_by_stage"] == out["train"]["minutes_by_stage"]
    assert again["train"]["minutes_from"] == "stage minutes in the log"
    assert again["eval"]["table"].keys() == out["eval"]["table"].keys()


def test_eval_only_without_a_finished_run_says_what_to_do(tmp_path):
    mask = kv_group_mask(tmp_path / "mask.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--config", str(ROOT / "experiments/train_hybrid/tiny.toml"),
                        "--out", str(tmp_path / "o"), "--tiny", "--mask", str(mask), "--eval-only"],
                       env=env, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode != 0 and "no finished run in" in p.stderr and "train first" in p.stderr


@pytest.mark.slow  # scoring 128 heads twice on CPU: minutes
def test_tiny_pipeline_selects_its_mask(tmp_path):
    out = run_script("--config", str(ROOT / "experiments/train_hybrid/tiny.toml"), "--out", str(tmp_path / "o"),
                     "--tiny", "--n", "1")
    check(out, tmp_path / "o")
    assert (tmp_path / "o" / "mask.json").exists() and len(out["mask"]["fa_heads"]) == 8
