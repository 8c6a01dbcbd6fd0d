"""research/train_hybrid/smollm2_stage1_speed.toml: the broad recipe's align stage at batch 16 and then 64, the
rest of the stage and the model as the broad recipe has them, so that its rates are that recipe's stage 1."""
from __future__ import annotations

import dataclasses

from recipe_diff import load


def test_two_align_stages_at_batch_16_and_64_as_the_broad_recipe_otherwise():
    speed, broad = load("smollm2_stage1_speed.toml"), load("smollm2_broad.toml")
    assert [(s.name, s.batch_size) for s in speed.stages] == [("align", 16), ("align", 64)]
    align = broad.stages[0]
    same = ("lr", "seq_len", "train_gdn_qkv", "schedule", "weight_decay", "grad_clip", "betas")
    for s in speed.stages:
        assert {f: getattr(s, f) for f in same} == {f: getattr(align, f) for f in same}
    for f in ("teacher", "mask", "compile", "teacher_dtype", "compile_teacher", "hybrid"):
        assert getattr(speed, f) == getattr(broad, f), f
    assert speed.eval == "none" and dataclasses.is_dataclass(speed)
