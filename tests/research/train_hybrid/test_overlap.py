"""research/train_hybrid/overlap.sh: two jobs in one command, B once A's hybrid is trained (launcher faked)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fake_launcher import run_script

SCRIPT = Path(__file__).resolve().parents[3] / "research" / "train_hybrid" / "overlap.sh"

FAKE = """#!/usr/bin/env bash
# python3 -m research.launch JOB --out DIR --resume [--stop-after S]: a job that trains, then exits with $RC_<JOB>
job=$3 out=$5
echo "$job $* cache=$HEADSCOPE_TEACHER_CACHE" >> "$CALLS"
h="$out/${HYBRID_AT:-run/hybrid}"; mkdir -p "$h" && echo '{}' > "$h/config.json"
echo "[launch] job $job done"
rc_var="RC_$job"; exit "${!rc_var:-0}"
"""


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return run_script(SCRIPT, FAKE, tmp_path, *args, **{"MIN_B": "0", **env})


def test_both_done_exits_0_and_b_stops_before_the_limit(tmp_path):
    r = _run(tmp_path, "jobA", "jobB", "400", str(tmp_path / "runs"))
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["jobA", "jobB"]  # B only after A's hybrid was there
    assert "--stop-after" in calls[1] and "--resume" in calls[0] and "--resume" in calls[1]
    stop = int(calls[1].split("--stop-after")[1].split()[0])
    assert 200 <= stop <= 250  # 150 s before the limit
    assert int(calls[0].split("--stop-after")[1].split()[0]) == 370  # A: STOP_A = 30 s before the limit
    assert len(list((tmp_path / "out").glob("jobA_*.log"))) == 1 and "[launch] job jobB done" in r.stdout
    assert all(c.endswith(f"cache={tmp_path / 'runs' / 'teacher_cache'}") for c in calls)  # one teacher cache


def test_a_studies_job_counts_as_trained_once_its_row_has_a_hybrid(tmp_path):
    r = _run(tmp_path, "jobA", "jobB", "400", str(tmp_path / "runs"),
             HYBRID_AT="study/variants/randglobal-kv/seed0/run/hybrid")
    assert r.returncode == 0 and "jobA trained; jobB: start" in r.stdout, r.stdout + r.stderr


def test_a_stops_stop_a_seconds_before_the_limit(tmp_path):
    r = _run(tmp_path, "jobA", "none", "400", str(tmp_path / "runs"), STOP_A="60")
    calls = (tmp_path / "calls").read_text().splitlines()
    assert int(calls[0].split("--stop-after")[1].split()[0]) == 340, r.stdout + r.stderr


def test_a_job_to_continue_exits_3(tmp_path):
    r = _run(tmp_path, "jobA", "jobB", "400", str(tmp_path / "runs"), RC_jobB="3")
    assert r.returncode == 3 and "jobB exit 3" in r.stdout


def test_b_waits_when_too_little_time_is_left(tmp_path):
    r = _run(tmp_path, "jobA", "jobB", "100", str(tmp_path / "runs"), MIN_B="240")
    assert r.returncode == 3 and "jobB: not started" in r.stdout
    assert [c.split()[0] for c in (tmp_path / "calls").read_text().splitlines()] == ["jobA"]


@pytest.mark.parametrize("args", [("jobA",), ("jobA", "jobB", "ten")])
def test_bad_arguments_say_how(tmp_path, args):
    r = _run(tmp_path, *args)
    assert r.returncode == 2 and ("SECONDS" in r.stderr or "overlap.sh JOB_A JOB_B" in r.stdout)
