"""What two recipe files differ in: each research recipe that varies another by one setting is held to that by a
test built on this."""
from __future__ import annotations

from pathlib import Path

RECIPES = Path(__file__).resolve().parents[3] / "research" / "train_hybrid"


def load(name: str):
    """research/train_hybrid/<name> as a TrainConfig (mask and out set, so no run folder is needed)."""
    from hybrid.train import TrainConfig

    return TrainConfig.from_file(RECIPES / name, mask="mask.json", out="run")


def recipe_diff(base: str, variant: str) -> dict:
    """{"top": {key: (base, variant)}, stage index: {key: (base, variant)}} for every setting that differs
    (a stage key absent from one side reads None); the stage counts must match."""
    b, v = load(base).to_dict(), load(variant).to_dict()
    b_stages, v_stages = b.pop("stages"), v.pop("stages")
    assert len(b_stages) == len(v_stages), (len(b_stages), len(v_stages))
    diff: dict = {}
    top = {k: (b.get(k), v.get(k)) for k in sorted(set(b) | set(v)) if b.get(k) != v.get(k)}
    if top:
        diff["top"] = top
    for i, (bs, vs) in enumerate(zip(b_stages, v_stages)):
        d = {k: (bs.get(k), vs.get(k)) for k in sorted(set(bs) | set(vs)) if bs.get(k) != vs.get(k)}
        if d:
            diff[i] = d
    return diff


def check_broad_jobs(recipe: str) -> None:
    """research/train_hybrid/<recipe>.toml's two jobs, ``<recipe>_hybrid`` and ``<recipe>_hybrid_seed1``: that
    file, the broad recipe's committed mask, the fidelity suite, and training seeds 0 (the default) and 1."""
    from research.launch.jobs import get_job

    for name, seed in ((f"{recipe}_hybrid", None), (f"{recipe}_hybrid_seed1", "1")):
        job = get_job(name)
        assert job.config == (f"research/train_hybrid/{recipe}.toml",)
        assert "research/train_hybrid/smollm2_broad_mask.json" in job.args and "fidelity" in job.args
        assert (job.args[job.args.index("--seed") + 1] if "--seed" in job.args else None) == seed


def check_more_distill(variant: str, steps: int, max_minutes: float, tokens: int,
                       base: str = "smollm2_broad_align_long_teacher_inputs.toml") -> None:
    """``variant`` is ``base`` with more distillation steps and a larger time cap for them, nothing else: its
    fidelity numbers against the base's measure the stage-2 tokens alone; stage 2 keeps the base's 64 rows a
    step in passes of 32, so that it fits an 80 GB card."""
    b = load(base).stages[1]
    assert recipe_diff(base, variant) == {1: {"max_minutes": (b.max_minutes, max_minutes), "steps": (b.steps, steps)}}
    distill = load(variant).stages[1]
    assert distill.steps * distill.batch_size * distill.seq_len == tokens
    assert (distill.batch_size, distill.micro_batch_size) == (64, 32)
