"""research.perf.compile_cache: the first compiled step with empty caches, then with the caches carried by
research.stage_caches into other folders (both in fresh processes): the carried run reads what the first wrote."""
from __future__ import annotations

import json

import pytest

from research.perf import compile_cache


@pytest.mark.slow  # two fresh processes compiling the reference hybrid's layers on the CPU (~1 minute)
def test_carried_caches_make_the_first_compiled_step_faster(tmp_path):
    out = compile_cache.main(["--model", "default", "--tokens", "16", "--out", str(tmp_path / "c.json")])
    assert out["parts"] >= 1 and out["archive_mb"] > 0
    assert out["carried"]["first_s"] < out["empty"]["first_s"]  # compiled code read back instead of built
    assert json.loads((tmp_path / "c.json").read_text())["first_step_ratio"] == out["first_step_ratio"]
