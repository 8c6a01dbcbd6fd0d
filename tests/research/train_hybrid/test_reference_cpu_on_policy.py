"""research/train_hybrid/reference_cpu_on_policy.toml: reference_cpu_align_long.toml with stage 2 on the student's
own continuations and nothing else changed, so that its fidelity numbers against that recipe's measure on-policy
distillation alone."""
from __future__ import annotations

from recipe_diff import load, recipe_diff


def test_only_stage_2_becomes_on_policy():
    assert recipe_diff("reference_cpu_align_long.toml", "reference_cpu_on_policy.toml") == {
        1: {"name": ("distill", "distill_on_policy"), "on_policy_tokens": (None, 128),
            "max_minutes": (20.0, 40.0)}}
    s2 = load("reference_cpu_on_policy.toml").stages[1]
    assert s2.sample_temperature == 1.0 and s2.seq_len - s2.on_policy_tokens == 384
