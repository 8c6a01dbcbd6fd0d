"""Run folders started before the mask/config fingerprint hashed RoPE settings record the teacher's legacy
fingerprint (headscope.mask.legacy_config_fingerprint): hybrid-train resumes them; another teacher is refused."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from headscope.mask import config_fingerprint, legacy_config_fingerprint
from hybrid.train import CheckpointError, latest_checkpoint, run
from train_factories import save_tiny_teacher, stage, tiny_config


class Killed(RuntimeError):
    pass


def kill_at(stage_name: str, step: int):
    def hook(name, done):
        if name == stage_name and done == step:
            raise Killed(f"killed after {name} step {done}")
    return hook


STAGES = [stage("align", steps=3, seq_len=32), stage("distill", steps=4, seq_len=32)]
KW = dict(stages=STAGES, checkpoint_every=2, keep_checkpoints=1)


def _started_before_rope_hashing(out, teacher_dir, mask_fingerprint_too: bool) -> None:
    """Rewrite ``out``'s run.json as a run started before RoPE settings were hashed recorded it."""
    cfg = AutoConfig.from_pretrained(teacher_dir)
    current, legacy = config_fingerprint(cfg), legacy_config_fingerprint(cfg)
    assert current != legacy  # the tiny Qwen3 teacher has RoPE settings
    record = json.loads((out / "run.json").read_text())
    assert record["identity"]["teacher"] == current
    assert "teacher_legacy" not in record["identity"]  # run.json keeps its former contents
    record["identity"]["teacher"] = legacy
    if mask_fingerprint_too:
        assert record["identity"]["mask"]["fingerprint"] == current
        record["identity"]["mask"]["fingerprint"] = legacy
    (out / "run.json").write_text(json.dumps(record))


@pytest.mark.parametrize("mask_fingerprint_too", [False, True])
def test_a_folder_recording_the_legacy_teacher_fingerprint_resumes_bit_identical(tmp_path, tiny_teacher_dir,
                                                                                 tiny_mask, mask_fingerprint_too):
    full = run(tiny_config(tmp_path / "a", tiny_teacher_dir, tiny_mask, **KW)).model.state_dict()
    cfg = tiny_config(tmp_path / "b", tiny_teacher_dir, tiny_mask, **KW)
    with pytest.raises(Killed):
        run(cfg, on_step=kill_at("distill", 3))
    _started_before_rope_hashing(tmp_path / "b", tiny_teacher_dir, mask_fingerprint_too)
    with pytest.raises(CheckpointError, match="already holds checkpoints of this run"):
        run(cfg)  # the same run: a fresh start over its checkpoints still needs --resume
    resumed = run(cfg, resume=True).model.state_dict()
    assert resumed.keys() == full.keys()
    for k in full:
        assert torch.equal(resumed[k], full[k]), k
    record = json.loads((tmp_path / "b" / "run.json").read_text())
    assert record["identity"]["teacher"] == config_fingerprint(AutoConfig.from_pretrained(tiny_teacher_dir))


def test_a_folder_of_another_teacher_is_still_refused(tmp_path, tiny_teacher_dir, tiny_mask, ref_tokenizer):
    cfg = tiny_config(tmp_path / "b", tiny_teacher_dir, tiny_mask, **KW)
    with pytest.raises(Killed):
        run(cfg, on_step=kill_at("align", 2))
    assert latest_checkpoint(tmp_path / "b") is not None
    other = save_tiny_teacher(tmp_path / "other", ref_tokenizer, intermediate_size=96)  # another architecture
    ocfg = AutoConfig.from_pretrained(other)
    for fingerprint in (config_fingerprint(ocfg), legacy_config_fingerprint(ocfg)):
        record = json.loads((tmp_path / "b" / "run.json").read_text())
        record["identity"]["teacher"] = fingerprint
        (tmp_path / "b" / "run.json").write_text(json.dumps(record))
        with pytest.raises(CheckpointError, match=r"belongs to a different run \(teacher: "):
            run(cfg, resume=True)


def test_the_legacy_fingerprint_of_a_teacher_that_differs_only_in_its_rope_base(tmp_path, tiny_teacher_dir,
                                                                                 tiny_mask, ref_tokenizer):
    """A teacher whose RoPE base differs has another current fingerprint; a folder recording that current
    fingerprint is refused (the legacy one cannot tell them apart, as it could not before)."""
    other = save_tiny_teacher(tmp_path / "other", ref_tokenizer,
                              rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
    ocfg, cfg0 = AutoConfig.from_pretrained(other), AutoConfig.from_pretrained(tiny_teacher_dir)
    assert config_fingerprint(ocfg) != config_fingerprint(cfg0)
    cfg = tiny_config(tmp_path / "b", tiny_teacher_dir, tiny_mask, **KW)
    with pytest.raises(Killed):
        run(cfg, on_step=kill_at("align", 2))
    record = json.loads((tmp_path / "b" / "run.json").read_text())
    record["identity"]["teacher"] = config_fingerprint(ocfg)
    (tmp_path / "b" / "run.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="belongs to a different run"):
        run(cfg, resume=True)
