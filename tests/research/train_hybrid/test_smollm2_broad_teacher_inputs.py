"""research/train_hybrid/smollm2_broad_teacher_inputs.toml: the broad recipe with stage 1 fed the teacher's layer
inputs and nothing else changed, so that its fidelity numbers against smollm2_broad.toml's measure that alone."""
from __future__ import annotations

from recipe_diff import check_broad_jobs, load, recipe_diff


def test_only_what_stage_1_reads_differs():
    assert recipe_diff("smollm2_broad.toml", "smollm2_broad_teacher_inputs.toml") == {
        0: {"align_inputs": (None, "teacher")}}
    assert load("smollm2_broad_teacher_inputs.toml").stages[0].train_gdn_qkv  # the default: q/k/v trained in stage 1


def test_jobs():
    check_broad_jobs("smollm2_broad_teacher_inputs")
