"""research/train_hybrid/reference_cpu_align_wide.toml: the 300-step CPU stage 1 at batch 16, nothing else changed,
so that against reference_cpu_align_long.toml (batch 4) and reference_cpu_align_900.toml (3x the steps) it tells
stage 1's steps from its tokens."""
from __future__ import annotations

from recipe_diff import recipe_diff


def test_only_the_align_batch_and_its_time_cap_differ():
    assert recipe_diff("reference_cpu_align_long.toml", "reference_cpu_align_wide.toml") == {
        0: {"batch_size": (4, 16), "max_minutes": (40.0, 80.0)}}
