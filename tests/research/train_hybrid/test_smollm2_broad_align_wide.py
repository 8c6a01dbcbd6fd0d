"""research/train_hybrid/smollm2_broad_align_wide.toml: the 3x stage 1 at batch 64, nothing else changed, so that
its fidelity numbers against smollm2_broad_align_long.toml's measure stage 1's batch (its tokens) alone."""
from __future__ import annotations

from recipe_diff import recipe_diff


def test_only_the_align_batch_and_its_time_cap_differ():
    assert recipe_diff("smollm2_broad_align_long.toml", "smollm2_broad_align_wide.toml") == {
        0: {"batch_size": (16, 64), "max_minutes": (6.0, 8.0)}}


def test_jobs():
    from research.launch.jobs import get_job

    for name, seed in (("smollm2_broad_align_wide_hybrid", None), ("smollm2_broad_align_wide_hybrid_seed1", "1")):
        job = get_job(name)
        assert job.config == ("research/train_hybrid/smollm2_broad_align_wide.toml",)
        assert "research/train_hybrid/smollm2_broad_mask.json" in job.args and "fidelity" in job.args
        assert (job.args[job.args.index("--seed") + 1] if "--seed" in job.args else None) == seed
