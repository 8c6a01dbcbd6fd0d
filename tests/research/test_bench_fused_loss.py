"""research/bench_fused_loss.py on tiny sizes (CPU): one naive and the fused rows, their errors against naive."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_bench_prints_and_writes_the_rows(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(ROOT / "research" / "bench_fused_loss.py"), "--device", "cpu",
                          "--B", "2", "--T", "16", "--V", "100", "--C", "8", "--Ct", "12", "--chunks", "5", "32",
                          "--temperature", "2", "--repeat", "1", "--threads", "1"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "fused 5" in res.stdout and "naive" in res.stdout
    rows = json.loads((tmp_path / "bench_fused_loss.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["naive", "fused 5", "fused 32"]
    for r in rows[1:]:
        assert r["loss_err"] < 1e-5 and r["grad_h_err"] < 1e-5 and r["grad_w_err"] < 1e-5, r
