"""research/train_hybrid/reference_cpu_kl_only.toml: reference_cpu.toml with stage 2's CE weight 0 and nothing else
changed, so that its fidelity against reference_cpu.toml's measures the CE term alone."""
from __future__ import annotations

from recipe_diff import recipe_diff


def test_only_the_distill_ce_weight_differs():
    assert recipe_diff("reference_cpu.toml", "reference_cpu_kl_only.toml") == {1: {"ce_weight": (0.2, 0.0)}}
