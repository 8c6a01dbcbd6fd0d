"""Runs a research shell script with ``python3`` on the PATH replaced by a fake launcher (a bash script), so the
scripts that drive ``python3 -m research.launch`` are tested without training anything."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


def run_script(script: Path, fake: str, tmp_path: Path, *args: str, cwd: Path | None = None,
               **env: str) -> subprocess.CompletedProcess:
    """``bash script args`` with ``fake`` as ``python3``, run in ``cwd`` (default: this process's); the fake appends
    its calls to ``$CALLS`` (tmp_path/calls), ``$OUT`` is tmp_path/out, ``POLL`` 0.2 s; ``env`` adds or overrides
    variables."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "python3").write_text(fake)
    (bin_ / "python3").chmod(0o755)
    e = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"),
         "OUT": str(tmp_path / "out"), "POLL": "0.2", **env}
    return subprocess.run(["bash", str(script), *args], env=e, capture_output=True, text=True, timeout=60, cwd=cwd)
