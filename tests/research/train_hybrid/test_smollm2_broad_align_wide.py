"""research/train_hybrid/smollm2_broad_align_wide.toml: the 3x stage 1 at batch 64, nothing else changed, so that
its fidelity numbers against smollm2_broad_align_long.toml's measure stage 1's batch (its tokens) alone."""
from __future__ import annotations

from recipe_diff import check_broad_jobs, recipe_diff


def test_only_the_align_batch_and_its_time_cap_differ():
    assert recipe_diff("smollm2_broad_align_long.toml", "smollm2_broad_align_wide.toml") == {
        0: {"batch_size": (16, 64), "max_minutes": (6.0, 8.0)}}


def test_jobs():
    check_broad_jobs("smollm2_broad_align_wide")
