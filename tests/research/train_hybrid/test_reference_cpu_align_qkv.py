"""research/train_hybrid/reference_cpu_align_qkv.toml: reference_cpu.toml with stage 1 training the GDN heads' q/k/v
too and nothing else changed, so that its fidelity against reference_cpu.toml's measures stage 1's scope alone."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def load(name: str):
    from hybrid.train import TrainConfig

    return TrainConfig.from_file(ROOT / "research" / "train_hybrid" / name, mask="mask.json", out="run")


def test_only_stage_one_scope_differs():
    base, wide = load("reference_cpu.toml"), load("reference_cpu_align_qkv.toml")
    assert [s.train_gdn_qkv for s in base.stages] == [False, True, True]
    assert [s.train_gdn_qkv for s in wide.stages] == [True, True, True]
    b, w = base.to_dict(), wide.to_dict()
    b_stages, w_stages = b.pop("stages"), w.pop("stages")
    assert b == w and len(b_stages) == len(w_stages) == 3
    assert b_stages[1:] == w_stages[1:]  # distill, long
    b0, w0 = dict(b_stages[0]), dict(w_stages[0])
    assert (b0.pop("train_gdn_qkv", True), w0.pop("train_gdn_qkv", True)) == (False, True) and b0 == w0


def test_align_long_differs_from_align_qkv_by_stage_one_length_alone():
    """reference_cpu_align_long.toml: reference_cpu_align_qkv.toml with stage 1 three times as long."""
    wide, long_ = load("reference_cpu_align_qkv.toml"), load("reference_cpu_align_long.toml")
    w, g = wide.to_dict(), long_.to_dict()
    w_stages, g_stages = w.pop("stages"), g.pop("stages")
    assert w == g and w_stages[1:] == g_stages[1:]
    w0, g0 = dict(w_stages[0]), dict(g_stages[0])
    assert (w0.pop("steps"), g0.pop("steps")) == (100, 300)
    assert w0.pop("max_minutes") < g0.pop("max_minutes") and w0 == g0
