"""research/bench_whole_model_gpu.py --dry-run on the CPU (tiny model): every section produces rows, the
measured cache bytes equal the analytic ones, the max-batch search stops at the emulated memory cap, and
research/render_whole_model.py renders the JSON into the docs table."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


MODELS = {"teacher", "hybrid_7to1", "layer_3to1"}


def run_script(name: str, *args: str) -> None:
    """An research/ script in a process of its own (tests never import scripts by path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(ROOT / "research" / f"{name}.py"), *args], check=True, env=env, cwd=ROOT)


def test_dry_run_writes_every_section_and_renders(tmp_path):
    out = tmp_path / "bench.json"
    run_script("bench_whole_model_gpu", "--dry-run", "--out", str(out), "--lengths", "48", "--contexts", "32",
               "--batches", "2", "1", "--steps", "2")
    data = json.loads(out.read_text())
    assert data["dry_run"] is True
    assert not data["skipped"]
    assert {r["model"] for r in data["decode"]} == MODELS
    assert all("step_ms" in r and r["speedup_vs_teacher"] > 0 for r in data["decode"])
    assert all("ms" in r for r in data["prefill"]) and len(data["prefill"]) == 3
    for r in data["cache_bytes"]:
        assert r["measured_bytes"] == r["analytic_bytes"] and r["rel_err_vs_formula"] < 1e-9
    mb = {r["model"]: r for r in data["max_batch"]}
    for r in mb.values():  # the largest batch under the cap: it fits, one more does not
        assert (r["max_batch"], True) in [tuple(t) for t in r["tried"]]
        assert (r["max_batch"] + 1, False) in [tuple(t) for t in r["tried"]]
    assert mb["hybrid_7to1"]["max_batch"] > mb["teacher"]["max_batch"]
    assert data["layer"] and data["layer"][0]["full16_fwd_ms"] > 0
    hybrid_md = (ROOT / "docs" / "hybrid.md").read_text()  # the markers the renderer fills, as the doc has them
    begin = re.search(r"^<!-- whole-model results: begin.*-->$", hybrid_md, flags=re.M).group(0)
    end = re.search(r"^<!-- whole-model results: end -->$", hybrid_md, flags=re.M).group(0)
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{begin}\nold\n{end}\noutro\n")
    run_script("render_whole_model", str(out), "--doc", str(doc))
    text = doc.read_text()
    assert "old" not in text and "intro" in text and "outro" in text
    assert "| decode" in text and "hybrid_7to1" in text


@pytest.mark.e2e
def test_dry_run_times_the_compiled_decode_step_beside_the_graph_step(tmp_path):
    """--compile-decode adds compiled_ms (the torch.compile'd step) to every decode row; step_ms stays the
    uncompiled step's, so the table's ratios do not change meaning."""
    out = tmp_path / "bench.json"  # --budget-s is a cap only: on busy cores 60 s skipped a model's row
    run_script("bench_whole_model_gpu", "--dry-run", "--compile-decode", "--out", str(out), "--lengths", "48",
               "--contexts", "32", "--batches", "1", "--steps", "2", "--budget-s", "600")
    rows = json.loads(out.read_text())["decode"]
    assert {r["model"] for r in rows} == MODELS
    for r in rows:
        assert "compiled_error" not in r, r
        assert r["compiled_ms"] > 0 and r["step_ms"] == r["eager_ms"]  # CPU: no graph, step_ms is the eager one
