"""research/train_hybrid/smollm2_broad_align_long.toml: the broad recipe with a 3x stage 1 and nothing else changed,
so that its fidelity numbers against smollm2_broad.toml's measure stage 1's length alone."""
from __future__ import annotations

from recipe_diff import load, recipe_diff


def test_only_the_align_steps_and_their_time_cap_differ():
    assert recipe_diff("smollm2_broad.toml", "smollm2_broad_align_long.toml") == {
        0: {"max_minutes": (2.0, 6.0), "steps": (180, 540)}}
    assert load("smollm2_broad_align_long.toml").stages[0].train_gdn_qkv  # the default: q/k/v trained in stage 1


def test_jobs():
    from research.launch.jobs import get_job

    for name, seed in (("smollm2_broad_align_long_hybrid", None), ("smollm2_broad_align_long_hybrid_seed1", "1")):
        job = get_job(name)
        assert job.config == ("research/train_hybrid/smollm2_broad_align_long.toml",)
        assert "research/train_hybrid/smollm2_broad_mask.json" in job.args and "fidelity" in job.args
        assert (job.args[job.args.index("--seed") + 1] if "--seed" in job.args else None) == seed
