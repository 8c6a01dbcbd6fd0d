"""experiments/bench_whole_model_gpu.py --dry-run on the CPU (tiny model): every section produces rows, the
measured cache bytes equal the analytic ones, the max-batch search stops at the emulated memory cap, and
experiments/render_whole_model.py renders the JSON into the docs table."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


def load(name):
    spec = importlib.util.spec_from_file_location(f"_exp_{name}", ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_writes_every_section_and_renders(tmp_path):
    bench = load("bench_whole_model_gpu")
    out = tmp_path / "bench.json"
    data = bench.main(["--dry-run", "--out", str(out), "--lengths", "48", "--contexts", "32",
                       "--batches", "2", "1", "--steps", "2"])
    assert json.loads(out.read_text())["dry_run"] is True
    assert not data["skipped"]
    assert {r["model"] for r in data["decode"]} == set(bench.MODELS)
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
    render = load("render_whole_model")
    table = render.render(data)
    assert "| decode" in table and "hybrid_7to1" in table
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{render.BEGIN}\nold\n{render.END}\noutro\n")
    render.main([str(out), "--doc", str(doc)])
    text = doc.read_text()
    assert "old" not in text and "intro" in text and "outro" in text and "hybrid_7to1" in text
