"""research/train_hybrid/smollm2_broad_align_900.toml: the broad recipe with a 5x stage 1 at the same batch and
nothing else changed, so that against smollm2_broad.toml and smollm2_broad_align_long.toml (3x) its fidelity numbers
measure stage 1's steps alone."""
from __future__ import annotations

from recipe_diff import check_broad_jobs, load, recipe_diff


def test_only_the_align_steps_and_their_time_cap_differ():
    assert recipe_diff("smollm2_broad_align_long.toml", "smollm2_broad_align_900.toml") == {
        0: {"max_minutes": (6.0, 8.0), "steps": (540, 900)}}
    align = load("smollm2_broad_align_900.toml").stages[0]
    assert align.train_gdn_qkv and align.batch_size == 16  # the default: q/k/v trained in stage 1


def test_jobs():
    check_broad_jobs("smollm2_broad_align_900")
