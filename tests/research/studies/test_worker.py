"""research/studies/worker.py: a SIGTERM while a variant trains (the runner's deadline) checkpoints the step under
way and stops; the next call resumes there and ends as if never stopped."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from train_factories import stage, tiny_config

from hybrid.train import latest_checkpoint, run
from hybrid.train.trainer import CheckpointAndStop
from research.studies import worker


def test_stop_on_term_asks_for_a_checkpoint_only_while_inside_and_never_at_a_stage_end():
    seen = []
    before = signal.getsignal(signal.SIGTERM)
    with worker._StopOnTerm(lambda st, k: seen.append((st, k)), {"align": 3}) as stop:
        stop("align", 1)  # no signal yet
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.asked
        stop("align", 3)  # the stage's last step: its own checkpoint follows, the training goes on
        with pytest.raises(CheckpointAndStop, match="SIGTERM at align step 2"):
            stop("align", 2)
    assert seen == [("align", 1), ("align", 3), ("align", 2)]  # the step timer still sees every step
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_sigterm_mid_stage_checkpoints_that_step_and_the_next_call_ends_bit_identical(tmp_path, monkeypatch,
                                                                                       tiny_teacher_dir, tiny_mask):
    stages = [stage("align", steps=3, seq_len=32), stage("distill", steps=4, seq_len=32)]
    kw = dict(stages=stages, checkpoint_every=0, keep_checkpoints=1)  # checkpoints only at stage ends
    full = run(tiny_config(tmp_path / "a", tiny_teacher_dir, tiny_mask, **kw)).model.state_dict()
    folder = tmp_path / "variant"
    folder.mkdir()
    cfg = tiny_config(folder / "run", tiny_teacher_dir, tiny_mask, **kw)
    (folder / "train.json").write_text(json.dumps(cfg.to_dict()))

    class TermAt(worker.StepTimer):  # the runner's SIGTERM arriving during distill step 2
        def __call__(self, stage_name, step):
            super().__call__(stage_name, step)
            if (stage_name, step) == ("distill", 2):
                os.kill(os.getpid(), signal.SIGTERM)

    plain = worker.StepTimer
    monkeypatch.setattr(worker, "StepTimer", TermAt)
    with pytest.raises(worker.TrainingStopped):
        worker.train_variant(folder, "v/seed0")
    assert latest_checkpoint(folder / "run").path.name == "s2-distill-000002"
    assert not (folder / "train_done.json").exists()
    monkeypatch.setattr(worker, "StepTimer", plain)
    summary = worker.train_variant(folder, "v/seed0")  # the next call: resumes at step 2, no signal this time
    assert summary["stages"]["distill"]["steps"] == 4 and (folder / "train_done.json").exists()
    from safetensors.torch import load_file

    saved = load_file(str(folder / "run" / "hybrid" / "model.safetensors"))
    shared = set(saved) & set(full)
    assert len(shared) >= len(saved) - 1  # every saved tensor (a tied output head may be left out of the file)
    for k in shared:
        assert torch.equal(saved[k], full[k]), k


def test_a_sigterm_while_evaluating_lets_the_part_in_hand_finish_then_stops():
    before = signal.getsignal(signal.SIGTERM)
    with worker._FinishOnTerm() as guard:
        guard.check("eval a")  # no signal yet: goes on
        os.kill(os.getpid(), signal.SIGTERM)  # the process is not ended: the part in hand goes on
        assert guard.asked
        with pytest.raises(worker.EvaluationStopped, match="stopped after eval b"):
            guard.check("eval b")
    assert signal.getsignal(signal.SIGTERM) == before
    assert issubclass(worker.EvaluationStopped, worker.Stopped) and issubclass(worker.TrainingStopped, worker.Stopped)
