"""research/train_hybrid/smollm2_broad_align_long_teacher_inputs.toml: the 3x-stage-1 broad recipe with stage 1 fed
the teacher's layer inputs and nothing else changed, so that its fidelity numbers against
smollm2_broad_align_long.toml's measure that alone."""
from __future__ import annotations

from recipe_diff import check_broad_jobs, load, recipe_diff


def test_only_what_stage_1_reads_differs():
    assert recipe_diff("smollm2_broad_align_long.toml", "smollm2_broad_align_long_teacher_inputs.toml") == {
        0: {"align_inputs": (None, "teacher")}, 1: {"micro_batch_size": (None, 32)}}
    # and against the teacher-inputs recipe, stage 1's length alone
    assert recipe_diff("smollm2_broad_teacher_inputs.toml", "smollm2_broad_align_long_teacher_inputs.toml") == {
        0: {"steps": (180, 540), "max_minutes": (2.0, 6.0)}}
    assert load("smollm2_broad_align_long_teacher_inputs.toml").stages[0].train_gdn_qkv


def test_jobs():
    check_broad_jobs("smollm2_broad_align_long_teacher_inputs")
