"""research/train_hybrid/smollm2_broad_align_long_teacher_inputs_distill780.toml: the 3x stage 1 on the teacher's
inputs with 3x the distillation steps and nothing else changed, so that its fidelity numbers against the parent's
two seeds measure the stage-2 tokens alone."""
from __future__ import annotations

from recipe_diff import check_broad_jobs, load, recipe_diff


def test_only_the_distill_steps_and_their_time_cap_differ():
    assert recipe_diff("smollm2_broad_align_long_teacher_inputs.toml",
                       "smollm2_broad_align_long_teacher_inputs_distill780.toml") == {
        1: {"max_minutes": (6.0, 13.0), "steps": (260, 780)}}
    distill = load("smollm2_broad_align_long_teacher_inputs_distill780.toml").stages[1]
    assert distill.steps * distill.batch_size * distill.seq_len == 102_236_160  # 3x the parent's 34.1 M
    assert (distill.batch_size, distill.micro_batch_size) == (64, 32)  # fits an 80 GB card


def test_jobs():
    check_broad_jobs("smollm2_broad_align_long_teacher_inputs_distill780")
