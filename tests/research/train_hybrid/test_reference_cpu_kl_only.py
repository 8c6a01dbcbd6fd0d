"""research/train_hybrid/reference_cpu_kl_only.toml: reference_cpu.toml with stage 2's CE weight 0 and nothing else
changed, so that its fidelity against reference_cpu.toml's measures the CE term alone."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def load(name: str):
    from hybrid.train import TrainConfig

    return TrainConfig.from_file(ROOT / "research" / "train_hybrid" / name, mask="mask.json", out="run")


def test_only_the_distill_ce_weight_differs():
    base, kl = load("reference_cpu.toml").to_dict(), load("reference_cpu_kl_only.toml").to_dict()
    b_stages, k_stages = base.pop("stages"), kl.pop("stages")
    assert base == kl and len(b_stages) == len(k_stages) == 3
    assert b_stages[0] == k_stages[0] and b_stages[2] == k_stages[2]  # align, long
    b, k = dict(b_stages[1]), dict(k_stages[1])
    assert (b.pop("ce_weight"), k.pop("ce_weight")) == (0.2, 0.0) and b == k
