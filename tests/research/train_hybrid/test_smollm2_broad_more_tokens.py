"""research/train_hybrid/smollm2_broad_more_tokens.toml: the broad recipe with more distillation steps and nothing
else changed, so that its fidelity numbers against smollm2_broad.toml's measure the tokens alone."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BROAD = ROOT / "research" / "train_hybrid" / "smollm2_broad.toml"
MORE = ROOT / "research" / "train_hybrid" / "smollm2_broad_more_tokens.toml"


def load(path: Path):
    from hybrid.train import TrainConfig

    return TrainConfig.from_file(path, mask="mask.json", out="run")


def test_only_the_distill_steps_and_their_time_cap_differ():
    broad, more = load(BROAD).to_dict(), load(MORE).to_dict()
    b_stages, m_stages = broad.pop("stages"), more.pop("stages")
    assert broad == more  # teacher, data mixture, corpus, teacher text, hybrid options, speed settings, seed
    assert b_stages[0] == m_stages[0]  # align
    b, m = dict(b_stages[1]), dict(m_stages[1])
    assert (b.pop("steps"), m.pop("steps")) == (260, 900)
    assert (b.pop("max_minutes"), m.pop("max_minutes")) == (6.0, 12.0)
    assert b == m  # lr, warm-up, batch, length, loss weights


def test_tokens_and_jobs():
    from research.launch.jobs import get_job

    distill = load(MORE).stages[1]
    assert distill.steps * distill.batch_size * distill.seq_len == 117_964_800  # 3.5x the broad recipe's 34.1 M
    for name, seed in (("smollm2_broad_more_tokens_hybrid", None), ("smollm2_broad_more_tokens_hybrid_seed1", "1")):
        job = get_job(name)
        assert job.config == ("research/train_hybrid/smollm2_broad_more_tokens.toml",)
        assert "research/train_hybrid/smollm2_broad_mask.json" in job.args and "fidelity" in job.args
        assert (job.args[job.args.index("--seed") + 1] if "--seed" in job.args else None) == seed
