from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.train.cli import main
from hybrid.train.logs import read_log

REPO = Path(__file__).resolve().parents[3]


def write_toml(path: Path, out: Path, teacher: Path, mask: Path, extra: str = "") -> Path:
    path.write_text(f'''
out = "{out}"
teacher = "{teacher}"
mask = "{mask}"
device = "cpu"
progress = false
eval = "none"
log_every = 1
threads = 1
checkpoint_every = 2
{extra}
[data]
text = 0.5
niah = 0.25
reasoning = 0.25
multikey = 0.0
copy = 0.0

[[stages]]
name = "align"
steps = 3
lr = 1e-2
seq_len = 32
batch_size = 4

[[stages]]
name = "distill"
steps = 3
lr = 3e-3
seq_len = 32
batch_size = 4

[[stages]]
name = "long"
steps = 2
lr = 3e-3
seq_len = 128
batch_size = 2
''')
    return path


def test_cli_trains_resumes_and_reports_errors(tmp_path, tiny_teacher_dir, tiny_mask, capsys):
    cfg = write_toml(tmp_path / "run.toml", tmp_path / "out", tiny_teacher_dir, tiny_mask)
    assert main(["--config", str(cfg), "--stage", "1"]) == 0
    assert (tmp_path / "out" / "checkpoints" / "s1-align-000003").exists()
    assert main(["--config", str(cfg), "--stage", "all", "--resume"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["model"].endswith("hybrid") and Path(printed["model"], "config.json").exists()
    assert main(["--config", str(cfg)]) == 2  # a fresh start over this run's checkpoints
    assert "pass --resume" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text(cfg.read_text().replace("threads = 1", "threads = 1\nlearning_rate = 3"))
    assert main(["--config", str(bad)]) == 2
    assert "unknown field(s) ['learning_rate']" in capsys.readouterr().err


def test_console_script_is_declared():
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["hybrid-train"] == "hybrid.train.cli:main"


@pytest.mark.slow  # ~30 s on 2 shared cores (two processes plus one)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_gloo_processes_match_one_process(tmp_path, tiny_teacher_dir, tiny_mask, mode):
    """DDP / FSDP2 on 2 CPU processes (gloo) and one process, same global batch: the same losses at every step."""
    one = write_toml(tmp_path / "one.toml", tmp_path / "one", tiny_teacher_dir, tiny_mask)
    two = write_toml(tmp_path / "two.toml", tmp_path / "two", tiny_teacher_dir, tiny_mask,
                     extra=f'distributed = "{mode}"')
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    assert main(["--config", str(one)]) == 0
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "hybrid.train.cli", "--config", str(two)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = [r for r in read_log(tmp_path / "one" / "log.jsonl") if "loss" in r]
    b = [r for r in read_log(tmp_path / "two" / "log.jsonl") if "loss" in r]
    assert [(r["stage"], r["step"]) for r in a] == [(r["stage"], r["step"]) for r in b] and len(a) == 8
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4, abs=1e-6), (ra, rb)
        assert rb["tokens"] == ra["tokens"]

