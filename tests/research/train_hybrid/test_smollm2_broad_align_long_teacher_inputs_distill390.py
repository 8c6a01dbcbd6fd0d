"""research/train_hybrid/smollm2_broad_align_long_teacher_inputs_distill390.toml: the 3x stage 1 on the teacher's
inputs with 1.5x the distillation steps and nothing else changed."""
from __future__ import annotations

from recipe_diff import check_broad_jobs, check_more_distill


def test_only_the_distill_steps_and_their_time_cap_differ():
    check_more_distill("smollm2_broad_align_long_teacher_inputs_distill390.toml", steps=390, max_minutes=9.0,
                       tokens=51_118_080)  # 1.5x the parent's 34.1 M


def test_jobs():
    check_broad_jobs("smollm2_broad_align_long_teacher_inputs_distill390")
