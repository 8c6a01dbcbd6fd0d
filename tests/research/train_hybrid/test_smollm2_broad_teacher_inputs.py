"""research/train_hybrid/smollm2_broad_teacher_inputs.toml: the broad recipe with stage 1 fed the teacher's layer
inputs and nothing else changed, so that its fidelity numbers against smollm2_broad.toml's measure that alone."""
from __future__ import annotations

import dataclasses

from recipe_diff import check_broad_jobs, load, recipe_diff


def test_only_what_stage_1_reads_differs():
    # and stage 2 in two passes of 32 rows (the same step: micro_batch_size is left out of the fingerprint)
    assert recipe_diff("smollm2_broad.toml", "smollm2_broad_teacher_inputs.toml") == {
        0: {"align_inputs": (None, "teacher")}, 1: {"micro_batch_size": (None, 32)}}
    cfg = load("smollm2_broad_teacher_inputs.toml")
    one_pass = [dataclasses.replace(s, micro_batch_size=0) for s in cfg.stages]
    assert cfg.replace(stages=one_pass).fingerprint() == cfg.fingerprint()
    assert load("smollm2_broad_teacher_inputs.toml").stages[0].train_gdn_qkv  # the default: q/k/v trained in stage 1


def test_jobs():
    check_broad_jobs("smollm2_broad_teacher_inputs")
