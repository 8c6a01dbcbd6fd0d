"""research/train_hybrid/detached.sh: one job across several commands, started once, detached by setsid, and
waited for by each call (launcher faked)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fake_launcher import run_script

SCRIPT = Path(__file__).resolve().parents[3] / "research" / "train_hybrid" / "detached.sh"

FAKE = """#!/usr/bin/env bash
# python3 -m research.launch JOB --out DIR --resume: sleeps $SLEEP s, then exits with $RC_<JOB>
job=$3 out=$5
echo "$job $* sid=$(ps -o sid= $$ | tr -d ' ') cwd=$PWD cache=$HEADSCOPE_TEACHER_CACHE" >> "$CALLS"
echo "[launch] job $job started"
sleep "${SLEEP:-0}"
mkdir -p "$out" && echo "[run.py] trained" && echo "[launch] job $job done"
rc_var="RC_$job"; exit "${!rc_var:-0}"
"""


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """In a small checkout (tmp_path/repo: a module, and a .stage part that the job's copy leaves out)."""
    repo = tmp_path / "repo"
    (repo / ".stage").mkdir(parents=True, exist_ok=True)
    (repo / "module.py").write_text("x = 1\n")
    (repo / ".stage" / "big.part1of2").write_text("part")
    return run_script(SCRIPT, FAKE, tmp_path, *args, cwd=repo, **env)


def _calls(tmp_path: Path) -> list[str]:
    f = tmp_path / "calls"
    return f.read_text().splitlines() if f.exists() else []


def test_a_job_that_ends_in_time_exits_with_its_status(tmp_path):
    runs = tmp_path / "runs"
    r = _run(tmp_path, "jobA", "30", str(runs))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[launch] job jobA done" in r.stdout and "ended with exit 0" in r.stdout
    calls = _calls(tmp_path)
    assert len(calls) == 1 and "--resume" in calls[0] and f"--out {runs / 'jobA'}" in calls[0]
    assert calls[0].endswith(f"cache={runs / 'teacher_cache'}")
    snap = runs / ".repo_jobA"  # the job runs from a copy of the checkout, the staged parts left out
    assert f"cwd={snap} " in calls[0] and (snap / "module.py").read_text() == "x = 1\n"
    assert not (snap / ".stage").exists()
    assert "[launch] job jobA done" in (tmp_path / "out" / "jobA.detached.log").read_text()
    # called again once done: nothing starts
    r = _run(tmp_path, "jobA", "30", str(runs))
    assert r.returncode == 0 and "already done" in r.stdout and len(_calls(tmp_path)) == 1


def test_a_longer_job_runs_on_detached_and_the_next_call_waits_for_it(tmp_path):
    runs = tmp_path / "runs"
    r = _run(tmp_path, "jobA", "1", str(runs), SLEEP="4")
    assert r.returncode == 3 and "call again" in r.stdout, r.stdout + r.stderr
    pid = int((runs / "jobA.detached.pid").read_text())
    os.kill(pid, 0)  # still running after the command returned
    assert int(_calls(tmp_path)[0].split("sid=")[1].split()[0]) != os.getsid(0)  # detached by setsid
    r = _run(tmp_path, "jobA", "30", str(runs), SLEEP="4")
    assert r.returncode == 0 and "running since an earlier command" in r.stdout, r.stdout + r.stderr
    assert "[launch] job jobA done" in r.stdout and "[launch] job jobA started" not in r.stdout  # new lines only
    assert len(_calls(tmp_path)) == 1  # started once


def test_a_job_that_failed_or_stopped_is_started_again(tmp_path):
    runs = tmp_path / "runs"
    r = _run(tmp_path, "jobA", "30", str(runs), RC_jobA="3")
    assert r.returncode == 3 and "ended with exit 3" in r.stdout, r.stdout + r.stderr
    r = _run(tmp_path, "jobA", "30", str(runs))
    assert r.returncode == 0 and "started (pid" in r.stdout and len(_calls(tmp_path)) == 2


@pytest.mark.parametrize("args", [(), ("jobA", "ten")])
def test_bad_arguments_say_how(tmp_path, args):
    r = _run(tmp_path, *args)
    assert r.returncode == 2 and ("SECONDS" in r.stderr or "detached.sh JOB" in r.stdout)
