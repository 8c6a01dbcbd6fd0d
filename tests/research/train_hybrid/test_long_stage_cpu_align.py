"""research/train_hybrid/long_stage_cpu.py's stage 1 keeps the behaviour its published numbers came from: only
the hybrid's new parameters train (train_gdn_qkv = false), whatever StageConfig's default."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[3]


def test_the_align_stage_pins_train_gdn_qkv_false(tmp_path):
    from hybrid.train import TrainConfig

    spec = importlib.util.spec_from_file_location("long_stage_cpu", ROOT / "research/train_hybrid/long_stage_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a = SimpleNamespace(corpus="heldout", haystack="heldout", teacher_samples=2, teacher_sample_len=16, short=32,
                        batch=4, align_steps=2, distill_steps=2, distill_lr=mod.DISTILL_LR, teacher="default",
                        mask=tmp_path / "mask.json", seed=0, log_every=1, threads=1)
    cfg = TrainConfig.from_dict(mod.base_config(a, tmp_path / "o"))
    align = next(s for s in cfg.stages if s.name == "align")
    assert align.train_gdn_qkv is False
    from hybrid.train.config import StageConfig

    assert StageConfig.__dataclass_fields__["train_gdn_qkv"].default is True  # the default it departs from
