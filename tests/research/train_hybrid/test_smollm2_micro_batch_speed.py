"""research/train_hybrid/smollm2_micro_batch_speed.toml: the broad recipe's stage 2 in passes of 16, 32 and 64 rows
(one pass last: it is the one that may run out of memory), the model and the stage otherwise as the recipe has them."""
from __future__ import annotations

from recipe_diff import load


def test_three_distill_stages_differing_in_their_passes_alone():
    speed, broad = load("smollm2_micro_batch_speed.toml"), load("smollm2_broad.toml")
    assert [(s.name, s.batch_size, s.micro_batch_size) for s in speed.stages] == [
        ("distill", 64, 16), ("distill", 64, 32), ("distill", 64, 0)]
    distill = broad.stages[1]
    same = ("lr", "seq_len", "weight_decay", "kl_weight", "ce_weight", "temperature", "fused_loss", "grad_clip")
    for s in speed.stages:
        assert {f: getattr(s, f) for f in same} == {f: getattr(distill, f) for f in same}
    for f in ("teacher", "mask", "compile", "teacher_dtype", "compile_teacher", "hybrid"):
        assert getattr(speed, f) == getattr(broad, f), f
    assert speed.eval == "none"
    fingerprints = {speed.replace(stages=[s]).fingerprint() for s in speed.stages}
    assert len(fingerprints) == 1  # the same stage, computed three ways


def test_its_job():
    from research.launch.jobs import get_job

    job = get_job("smollm2_micro_batch_speed")
    assert job.kind == "trainer_throughput" and job.config == ("research/train_hybrid/smollm2_micro_batch_speed.toml",)
