"""research/decode_levers.sh: an unknown part is refused with the list, and each part runs its job's program with
the job's args from research/jobs.toml (a stand-in python3 records the commands; the job lookup runs for real)."""
import os
import subprocess
import sys
from pathlib import Path

from research.launch import get_job

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "research" / "decode_levers.sh"


def test_an_unknown_part_is_refused_with_the_list():
    r = subprocess.run(["bash", str(SCRIPT), "nope"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "unknown part 'nope'" in r.stderr and "split_pdl" in r.stderr


def test_each_part_runs_its_jobs_program_with_the_jobs_args(tmp_path):
    log = tmp_path / "commands.log"
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
                    f'printf "%s\\n" "$*" >> {log}\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run(["bash", str(SCRIPT), "tests", "pdl", "pdl_128k", "split_pdl", "tests_gemv", "gemv",
                        "gemv_sweep"],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    ran = log.read_text().splitlines()
    args = lambda job: " ".join(map(str, get_job(job).args))  # noqa: E731
    assert ran == [f"-m pytest -m gpu -q -p no:cacheprovider {args('gpu_tests_pdl')}",
                   f"-m research.bench_whole_model_gpu {args('bench_decode_pdl')} --out {tmp_path}/bench_pdl_run1.json",
                   f"-m research.bench_whole_model_gpu {args('bench_decode_pdl_128k')} "
                   f"--out {tmp_path}/bench_pdl_128k_run1.json",
                   f"-m research.count_decode_ops {args('decode_time_split_pdl')} "
                   f"--json {tmp_path}/time_split_pdl.json",
                   f"-m pytest -m gpu -q -p no:cacheprovider {args('gpu_tests_gemv')}",
                   f"-m research.bench_whole_model_gpu {args('bench_decode_gemv')} "
                   f"--out {tmp_path}/bench_gemv_run1.json",
                   f"-m research.perf.gemv_sweep {args('gemv_sweep')} --out {tmp_path}/gemv_sweep.json"]
