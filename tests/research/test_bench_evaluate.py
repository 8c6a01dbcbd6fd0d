"""research/bench_evaluate.py on a tiny model (CPU): progress lines, the JSON rewritten after each evaluation
(a run that fails half-way leaves what it measured, marked partial), and the time limit's skipped rows."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SETS = ["niah.lengths=[200]", "niah.depths=[0.0,1.0]", "niah_multikey.lengths=[200]", "niah_multikey.n_keys=[2]",
        "template_transfer.lengths=[200]", "reasoning.sizes=[]", "perplexity.lengths=[32,64]", "perplexity.bins=4",
        "cost.lengths=[32]", "cost.decode_context=32", "cost.decode_tokens=2", "cost.repeats=1"]
EVALS = ["niah", "niah_multikey", "template_transfer", "reasoning", "perplexity", "cost"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from char_tokenizer import char_tokenizer
    from model_factories import tiny_model

    d = tmp_path_factory.mktemp("tiny")
    tiny_model("qwen3").save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return d


def bench(folder, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """The script in a process of its own (tests never import scripts by path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    sets = [x for s in SETS for x in ("--set", s)]
    return subprocess.run([sys.executable, str(ROOT / "research" / "bench_evaluate.py"), "--part", "gpu",
                           "--model", str(folder), "--n-scale", "0.05", "--threads", "1", "--json", str(out), *sets,
                           *extra], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_progress_lines_and_final_json(folder, tmp_path):
    res = bench(folder, tmp_path / "b.json", "--budget", "600", "--watchdog", "600")
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["partial"] is False and data["done"] == EVALS and not data["skipped_for_budget"]
    assert data["meta"]["context"]["budget_s"] == 600
    for line in ("bench_evaluate --part gpu: python", "[eval", "niah @200: start", "niah @200: done in",
                 "perplexity @64: done in", "cost: done in"):
        assert line in res.stderr, line


def test_a_failing_run_leaves_partial_json(folder, tmp_path):
    res = bench(folder, tmp_path / "b.json", "--set", "perplexity.text=/nonexistent/heldout.txt")
    assert res.returncode != 0 and "nonexistent" in res.stderr
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["partial"] is True and data["done"] == EVALS[:4]  # written after each evaluation before it
    assert {r["evaluation"] for r in data["summary"]} == set(EVALS[:4])


def test_time_limit_gives_skipped_rows(folder, tmp_path):
    res = bench(folder, tmp_path / "b.json", "--time-limit", "1e-6")
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["partial"] is False and data["done"] == EVALS
    assert {r["evaluation"] for r in data["skipped_for_budget"]} == set(EVALS)
    assert all(r["note"].startswith("budget:") for r in data["skipped_for_budget"])
