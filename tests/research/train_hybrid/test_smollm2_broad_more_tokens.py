"""research/train_hybrid/smollm2_broad_more_tokens.toml: the broad recipe with more distillation steps and nothing
else changed, so that its fidelity numbers against smollm2_broad.toml's measure the tokens alone."""
from __future__ import annotations

from recipe_diff import load, recipe_diff


def test_only_the_distill_steps_and_their_time_cap_differ():
    # teacher, data mixture, corpus, teacher text, hybrid options, speed settings, seed, align; lr, warm-up, batch,
    # length and loss weights of distill: all equal
    assert recipe_diff("smollm2_broad.toml", "smollm2_broad_more_tokens.toml") == {
        1: {"max_minutes": (6.0, 12.0), "steps": (260, 900)}}


def test_tokens_and_jobs():
    from research.launch.jobs import get_job

    distill = load("smollm2_broad_more_tokens.toml").stages[1]
    assert distill.steps * distill.batch_size * distill.seq_len == 117_964_800  # 3.5x the broad recipe's 34.1 M
    for name, seed in (("smollm2_broad_more_tokens_hybrid", None), ("smollm2_broad_more_tokens_hybrid_seed1", "1")):
        job = get_job(name)
        assert job.config == ("research/train_hybrid/smollm2_broad_more_tokens.toml",)
        assert "research/train_hybrid/smollm2_broad_mask.json" in job.args and "fidelity" in job.args
        assert (job.args[job.args.index("--seed") + 1] if "--seed" in job.args else None) == seed
