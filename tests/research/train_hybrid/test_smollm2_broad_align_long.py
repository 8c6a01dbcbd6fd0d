"""research/train_hybrid/smollm2_broad_align_long.toml: the broad recipe with a 3x stage 1 and nothing else changed,
so that its fidelity numbers against smollm2_broad.toml's measure stage 1's length alone."""
from __future__ import annotations

from recipe_diff import check_broad_jobs, load, recipe_diff


def test_only_the_align_steps_and_their_time_cap_differ():
    assert recipe_diff("smollm2_broad.toml", "smollm2_broad_align_long.toml") == {
        0: {"max_minutes": (2.0, 6.0), "steps": (180, 540)}}
    assert load("smollm2_broad_align_long.toml").stages[0].train_gdn_qkv  # the default: q/k/v trained in stage 1


def test_jobs():
    check_broad_jobs("smollm2_broad_align_long")
