"""research/train_hybrid/smollm2_broad_align_long.toml: the broad recipe with a 3x stage 1 and nothing else changed,
so that its fidelity numbers against smollm2_broad.toml's measure stage 1's length alone."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BROAD = ROOT / "research" / "train_hybrid" / "smollm2_broad.toml"
LONG = ROOT / "research" / "train_hybrid" / "smollm2_broad_align_long.toml"


def load(path: Path):
    from hybrid.train import TrainConfig

    return TrainConfig.from_file(path, mask="mask.json", out="run")


def test_only_the_align_steps_and_their_time_cap_differ():
    broad, long_ = load(BROAD).to_dict(), load(LONG).to_dict()
    b_stages, l_stages = broad.pop("stages"), long_.pop("stages")
    assert broad == long_  # teacher, data mixture, corpus, teacher text, hybrid options, speed settings, seed
    assert b_stages[1:] == l_stages[1:]  # distill
    b, g = dict(b_stages[0]), dict(l_stages[0])
    assert (b.pop("steps"), g.pop("steps")) == (180, 540)
    assert (b.pop("max_minutes"), g.pop("max_minutes")) == (2.0, 6.0)
    assert b == g  # lr, warm-up, batch, length, train_gdn_qkv (the default: true)
    assert load(LONG).stages[0].train_gdn_qkv


def test_jobs():
    from research.launch.jobs import get_job

    for name, seed in (("smollm2_broad_align_long_hybrid", None), ("smollm2_broad_align_long_hybrid_seed1", "1")):
        job = get_job(name)
        assert job.config == ("research/train_hybrid/smollm2_broad_align_long.toml",)
        assert "research/train_hybrid/smollm2_broad_mask.json" in job.args and "fidelity" in job.args
        assert (job.args[job.args.index("--seed") + 1] if "--seed" in job.args else None) == seed
