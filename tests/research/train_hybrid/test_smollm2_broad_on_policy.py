"""research/train_hybrid/smollm2_broad_on_policy.toml: the best broad recipe (a 3x stage 1 on the teacher's inputs)
with stage 2 on the student's own continuations, nothing else changed, so that its fidelity numbers against
smollm2_broad_align_long_teacher_inputs.toml's two seeds measure on-policy distillation alone."""
from __future__ import annotations

from recipe_diff import load, recipe_diff


def test_only_stage_2_becomes_on_policy():
    assert recipe_diff("smollm2_broad_align_long_teacher_inputs.toml", "smollm2_broad_on_policy.toml") == {
        1: {"name": ("distill", "distill_on_policy"), "on_policy_tokens": (None, 256),
            "max_minutes": (6.0, 12.0)}}
    s2 = load("smollm2_broad_on_policy.toml").stages[1]
    assert s2.sample_temperature == 1.0 and s2.seq_len - s2.on_policy_tokens == 1792
    assert s2.micro_batch_size == 32  # two passes: the step fits an 80 GB GPU


def test_job():
    from research.launch.jobs import get_job

    job = get_job("smollm2_broad_on_policy_hybrid")
    assert job.config == ("research/train_hybrid/smollm2_broad_on_policy.toml",)
    assert "research/train_hybrid/smollm2_broad_mask.json" in job.args and "fidelity" in job.args
