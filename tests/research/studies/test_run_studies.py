"""research/studies/run_studies.py --dry-run and render_studies.py, run as processes (never imported): the
CPU pipeline, skipping finished variants, resuming a killed one, the tables, and refusals."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUN = ROOT / "research" / "studies" / "run_studies.py"
RENDER = ROOT / "research" / "studies" / "render_studies.py"
CONFIG = ROOT / "research" / "studies" / "reference.toml"


def script(path: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("STEPS_SCALE", None)
    p = subprocess.run([sys.executable, str(path), *args], env=env, cwd=ROOT, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def runs(out: Path) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads((out / "studies.json").read_text())["runs"]}


def test_teacher_and_an_infeasible_variant_then_skip_and_render(tmp_path):
    out = tmp_path / "st"
    script(RUN, "--config", str(CONFIG), "--out", str(out), "--dry-run", "--only", "teacher,fixed-kv")
    r = runs(out)
    assert r["teacher"]["status"] == "done" and r["fixed-kv"]["status"] == "infeasible"
    assert "not the budget's 4" in r["fixed-kv"]["reason"]
    m = r["teacher"]["metrics"]
    assert set(m["niah"]) == {"120", "248"} and 0 <= m["niah"]["248"] <= 1 and m["ppl"] > 1
    assert set(m["reasoning_by_family"]) == {"arithmetic", "binding", "comparison", "two_hop"}
    assert r["global-kv"]["status"] == "not run yet"  # not in --only
    again = script(RUN, "--config", str(CONFIG), "--out", str(out), "--dry-run", "--only", "teacher,fixed-kv")
    assert "teacher seed 0: done earlier, skipped" in again.stdout and "started" not in again.stdout
    docs = tmp_path / "results.md"
    shutil.copy(ROOT / "docs" / "results.md", docs)
    script(RENDER, "--run", str(out), "--out", str(tmp_path / "r"), "--docs", str(docs))
    tables = (tmp_path / "r" / "tables.md").read_text()
    assert "CPU dry run (tiny settings), not a result" in tables and "infeasible: strategy 'fixed_ratio'" in tables
    assert (tmp_path / "r" / "studies.html").exists() and tables in docs.read_text()
    assert len(json.loads((out / "calls.json").read_text())["calls"]) == 2


def test_bad_input_is_refused(tmp_path):
    p = script(RUN, "--config", str(CONFIG), "--out", str(tmp_path / "o"), "--dry-run", "--only", "nope", check=False)
    assert p.returncode == 2 and "--only ['nope']" in p.stderr
    p = script(RENDER, "--run", str(tmp_path / "empty"), check=False)
    assert p.returncode == 2 and "no study.json" in p.stderr


@pytest.mark.slow  # trains 3 hybrids on CPU, twice in part: ~1-2 minutes on 2 idle cores
def test_dry_run_trains_evaluates_and_resumes(tmp_path):
    out = tmp_path / "st"
    script(RUN, "--config", str(CONFIG), "--out", str(out), "--dry-run")
    r = runs(out)
    assert {n: x["status"] for n, x in r.items() if n in ("teacher", "global-kv", "fixed-kv", "layerwise-7to1",
                                                         "token-swa257")} == {
        "teacher": "done", "global-kv": "done", "fixed-kv": "infeasible", "layerwise-7to1": "done",
        "token-swa257": "done"}
    assert r["global-kv"]["info"]["kv_share"] == pytest.approx(1 / 8)
    assert r["token-swa257"]["info"]["kv_share"] == pytest.approx(1 / 8)
    assert r["layerwise-7to1"]["info"]["layers_with_fa"] == 1
    assert r["global-kv"]["train"]["stages"]["distill"]["steps"] == 2 and not r["global-kv"]["train"]["capped"]
    # the tuned teacher: an all-FA hybrid with nothing new, trained by stages 2-3 only (its train.json has no align)
    assert r["teacher-tuned"]["status"] == "done" and r["teacher-tuned"]["info"]["kv_share"] == 1.0
    assert set(r["teacher-tuned"]["train"]["stages"]) == {"distill", "long"}
    train = json.loads((out / "variants" / "teacher-tuned" / "seed0" / "train.json").read_text())
    assert [s["name"] for s in train["stages"]] == ["distill", "long"] and train["hybrid"]["fa_gate"] == "none"
    # a kill after training, before the final save and the last evaluation item: the same command continues it
    d = out / "variants" / "global-kv" / "seed0"
    for f in ("result.json", "train_done.json", "eval/niah@248.json"):
        (d / f).unlink()
    shutil.rmtree(d / "run" / "hybrid")
    p = script(RUN, "--config", str(CONFIG), "--out", str(out), "--dry-run", "--steps-scale", "2", check=False)
    assert p.returncode == 2 and "same --steps-scale" in p.stderr  # another budget over its checkpoints: refused
    again = script(RUN, "--config", str(CONFIG), "--out", str(out), "--dry-run")
    log = (d / "worker.log").read_text()
    assert "resumed from s3-long-000001" in log and log.count("eval niah@248") == 2
    assert log.count("eval niah@120") == 1  # items written before the kill are not run again
    assert "layerwise-7to1 seed 0: done earlier, skipped" in again.stdout
    assert runs(out)["global-kv"]["status"] == "done" and (d / "run" / "hybrid" / "config.json").exists()
    # unfinished under another budget: --restart-changed trains it again from the teacher with the new steps
    (d / "result.json").unlink()
    script(RUN, "--config", str(CONFIG), "--out", str(out), "--dry-run", "--steps-scale", "2", "--only",
           "global-kv", "--restart-changed")
    r = runs(out)["global-kv"]
    assert r["status"] == "done" and r["train"]["stages"]["distill"]["steps"] == 4
    starts = [x for x in (d / "worker.log").read_text().splitlines() if x.startswith("[global-kv/seed0] training")]
    assert "resumed" not in starts[-1] and "('distill', 4, 128, 1)" in starts[-1]  # from the teacher, not resumed


@pytest.mark.slow  # ~1 minute: 50 training steps on CPU, stopped, then continued
def test_a_study_stopped_mid_training_continues_from_its_checkpoint(tmp_path):
    out = tmp_path / "st"
    args = ("--config", str(CONFIG), "--out", str(out), "--dry-run", "--only", "global-kv", "--steps-scale", "10")
    stopped = script(RUN, *args, "--deadline-s", "15", check=False)  # align 20, distill 20, long 10 steps
    assert stopped.returncode == 3 and "deadline 15 s reached" in stopped.stdout
    assert "global-kv/seed0: training unfinished" in stopped.stdout
    ckpts = out / "variants" / "global-kv" / "seed0" / "run" / "checkpoints"
    latest = (ckpts / "LATEST").read_text().strip()  # checkpoint_every = 1 in the dry run
    script(RUN, *args)  # the same command continues
    log = (out / "variants" / "global-kv" / "seed0" / "worker.log").read_text()
    assert f"resumed from {latest}" in log
    _, stage_name, step = latest.split("-")  # the worker checkpointed the step the runner's SIGTERM found
    assert f"stopped: SIGTERM at {stage_name} step {int(step)}; checkpointed" in log
    r = runs(out)["global-kv"]
    assert r["status"] == "done" and r["train"]["stages"]["long"]["steps"] == 10


@pytest.mark.slow  # ~1 minute: the selector (4 steps) in the main process, then 5 training steps and the evaluation
def test_the_learned_selector_row_trains_its_gates_then_the_stages(tmp_path):
    out = tmp_path / "st"
    first = script(RUN, "--config", str(CONFIG), "--out", str(out), "--dry-run", "--only", "learned-kv")
    assert "learned-kv seed 0: training its selector on cpu" in first.stdout
    r = runs(out)["learned-kv"]
    assert r["status"] == "done" and r["info"]["kv_share"] == pytest.approx(1 / 8)
    assert r["info"]["settings"]["strategy"] == "learned" and r["info"]["settings"]["selector"]["steps"] == 4
    d = out / "variants" / "learned-kv" / "seed0"
    assert (d / "selector.json").exists() and r["train"]["stages"]["long"]["steps"] == 1
    script(RENDER, "--run", str(out), "--out", str(tmp_path / "r"))
    tables = (tmp_path / "r" / "tables.md").read_text()
    assert "### Study 7: a learned selector" in tables and "| learned-kv | learned gates (global top), 1/8 of the KV " \
        "groups |" in tables
