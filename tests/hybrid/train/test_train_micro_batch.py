"""StageConfig.micro_batch_size: a step's rows in several forward/backward passes whose gradients add up, each term
divided by the whole batch's count (Stage.counts), so a split step is the one-pass step in less memory."""
from __future__ import annotations

import json

import pytest
import torch

from hybrid.train import TrainConfigError, run
from train_factories import stage, tiny_config

# the data's task rows weigh only their answers, so the CE counts differ between a step's rows: a pass normalised
# by its own count would weigh the terms differently from the one-pass step, which the comparison below would see
STAGES = [stage("align", steps=3, seq_len=32, batch_size=4), stage("distill", steps=3, seq_len=32, batch_size=4),
          stage("long", steps=2, seq_len=128, batch_size=2)]


def _split(stages, sizes):
    return [{**s, "micro_batch_size": m} for s, m in zip(stages, sizes)]


def _log(folder):
    return [json.loads(l) for l in (folder / "log.jsonl").read_text().splitlines()]


def _first_step_grads(folder, teacher, mask, st, monkeypatch, **kw) -> list[torch.Tensor]:
    """The gradients the optimizer's first step sees (copies), from a run of the one stage ``st`` (``kw``: the
    run's other settings)."""
    from hybrid.train import trainer as trainer_mod

    seen: list[list[torch.Tensor]] = []
    real = torch.nn.utils.clip_grad_norm_

    def record(params, max_norm, *args, **kwargs):
        params = list(params)
        seen.append([p.grad.detach().clone() for p in params if p.grad is not None])
        return real(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(trainer_mod.torch.nn.utils, "clip_grad_norm_", record)
    run(tiny_config(folder, teacher, mask, stages=[{**st, "steps": 1}], **kw))
    monkeypatch.undo()
    return seen[0]


# long_distill: the KL on each row's first 64 of 128 positions (kl_positions), the CE on all of them
LONG_DISTILL = stage("long_distill", steps=2, seq_len=128, batch_size=2, kl_positions=64)


@pytest.mark.parametrize("st,micro", [(STAGES[0], 1), (STAGES[1], 2), (STAGES[1], 1), (STAGES[2], 1),
                                      (LONG_DISTILL, 1), ({**LONG_DISTILL, "kl_positions": 0}, 1)],
                         ids=["align-1", "distill-2", "distill-1", "long-1", "long_distill-1",
                              "long_distill-teacher-positions-1"])
def test_a_split_step_has_the_one_pass_gradient(tmp_path, tiny_teacher_dir, tiny_mask, monkeypatch, st, micro):
    one = _first_step_grads(tmp_path / "one", tiny_teacher_dir, tiny_mask, st, monkeypatch)
    split = _first_step_grads(tmp_path / "split", tiny_teacher_dir, tiny_mask, {**st, "micro_batch_size": micro},
                              monkeypatch)
    assert len(one) == len(split) > 0
    assert sum(float(g.abs().sum()) for g in one) > 0  # a gradient to compare
    for a, b in zip(one, split):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_a_split_run_logs_the_one_pass_losses(tmp_path, tiny_teacher_dir, tiny_mask):
    """Three stages, each split: every logged loss term, the tokens and the steps as one pass gives them (the
    weights drift apart only by float rounding, which AdamW's first steps amplify on tiny gradients)."""
    run(tiny_config(tmp_path / "one", tiny_teacher_dir, tiny_mask, stages=STAGES))
    run(tiny_config(tmp_path / "split", tiny_teacher_dir, tiny_mask, stages=_split(STAGES, (1, 2, 1))))
    la = [r for r in _log(tmp_path / "one") if "loss" in r]
    lb = [r for r in _log(tmp_path / "split") if "loss" in r]
    assert [(r["stage"], r["step"]) for r in la] == [(r["stage"], r["step"]) for r in lb]
    assert {r["stage"] for r in la} == {"align", "distill", "long"}
    for ra, rb in zip(la, lb):
        for key in [k for k in ra if k.startswith("loss")]:
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-7), (ra["stage"], ra["step"], key)
        assert rb["tokens"] == ra["tokens"]


def test_micro_batch_size_is_bookkeeping_for_the_fingerprint(tmp_path, tiny_teacher_dir, tiny_mask):
    one = tiny_config(tmp_path / "a", tiny_teacher_dir, tiny_mask, stages=STAGES)
    split = tiny_config(tmp_path / "a", tiny_teacher_dir, tiny_mask, stages=_split(STAGES, (2, 2, 1)))
    assert split.fingerprint() == one.fingerprint()
    assert "micro_batch_size" not in one.to_dict()["stages"][0]  # the default leaves the dict as it was
    assert split.to_dict()["stages"][1]["micro_batch_size"] == 2


@pytest.mark.parametrize("bad,why", [(-1, "must be an int >= 0"), (3, "must divide batch_size=4"),
                                     (1.5, "must be an int >= 0"), (True, "must be an int >= 0")])
def test_a_bad_micro_batch_size_is_refused(bad, why):
    from hybrid.train.config import StageConfig

    with pytest.raises(TrainConfigError, match=why):
        StageConfig(**stage("distill", batch_size=4, micro_batch_size=bad))


def test_a_stage_without_counts_refuses_micro_batches():
    import dataclasses

    from hybrid.train.config import StageConfig
    from hybrid.train.stages import STAGES, register_stage

    register_stage(dataclasses.replace(STAGES["distill"], name="distill_without_counts", counts=None))
    try:
        with pytest.raises(TrainConfigError, match="cannot give its loss's counts"):
            StageConfig(**stage("distill_without_counts", batch_size=4, micro_batch_size=2))
    finally:
        STAGES.unregister("distill_without_counts")


def test_an_on_policy_step_split_into_passes_has_the_one_pass_gradient(tmp_path, tiny_teacher_dir, tiny_mask,
                                                                        monkeypatch):
    """distill_on_policy in passes (what an 80 GB GPU needs at 64 rows of 2048): at sampling temperature 0 each
    row's continuation is the same in a pass as in the whole batch, so the split step is the one-pass step; its
    counts() are what its loss counts over the passes (the trainer checks it)."""
    st = stage("distill_on_policy", steps=1, seq_len=32, batch_size=4, on_policy_tokens=8, sample_temperature=0.0)
    one = _first_step_grads(tmp_path / "one", tiny_teacher_dir, tiny_mask, st, monkeypatch)
    split = _first_step_grads(tmp_path / "split", tiny_teacher_dir, tiny_mask, {**st, "micro_batch_size": 2},
                              monkeypatch)
    assert len(one) == len(split) > 0 and sum(float(g.abs().sum()) for g in one) > 0
    for a, b in zip(one, split):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_on_policy_counts_are_the_losss_own(tiny_teacher_dir, tiny_mask):
    """The counts on_policy_counts gives without sampling equal the counts of the loss's terms (KL over every
    position, CE over the corpus part's weights), and a split step's loss names only those terms."""
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM

    from headscope.mask import HeadMask
    from hybrid.convert import from_mask
    from hybrid.train.config import StageConfig
    from hybrid.train.stages import STAGES

    teacher = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir).eval()
    student = from_mask(teacher, HeadMask.from_json(tiny_mask)).train()
    torch.manual_seed(0)
    ids = torch.randint(5, 4000, (2, 24))  # [B, T]
    w = torch.rand(2, 24)  # [B, T]: uneven weights, as task rows give
    cfg = StageConfig(name="distill_on_policy", steps=1, lr=1e-3, seq_len=24, batch_size=4, on_policy_tokens=6,
                      micro_batch_size=2)
    terms = STAGES["distill_on_policy"].loss(cfg, student, teacher, ids, w, nullcontext())
    counts = STAGES["distill_on_policy"].counts(cfg, ids, w)
    assert [n for n, *_ in terms] == ["kl", "ce"]
    assert [float(c) for *_, c in terms] == pytest.approx([float(c) for c in counts])
    assert float(counts[1]) == pytest.approx(float(w[:, :24 - 6 - 1].sum()))  # the corpus part's targets only


def test_passes_that_do_not_split_the_process_rows_are_refused(tmp_path, tiny_teacher_dir, tiny_mask, monkeypatch):
    """batch_size 4 over one process splits into passes of 2; a process with 3 rows (as a batch over processes
    could leave it) is refused with the numbers, not trained on uneven passes."""
    from hybrid.train import trainer as trainer_mod

    cfg = tiny_config(tmp_path / "a", tiny_teacher_dir, tiny_mask,
                      stages=[{**stage("distill", steps=1, seq_len=32, batch_size=4), "micro_batch_size": 2}])
    real = trainer_mod.Trainer._forward_backward

    def three_rows(self, stage_, s, model, teacher, ids, w, autocast):
        return real(self, stage_, s, model, teacher, ids[:3], w[:3], autocast)

    monkeypatch.setattr(trainer_mod.Trainer, "_forward_backward", three_rows)
    with pytest.raises(TrainConfigError, match="3 rows a step"):
        run(cfg)


def test_counts_that_disagree_with_the_loss_are_caught(tmp_path, tiny_teacher_dir, tiny_mask, monkeypatch):
    from dataclasses import replace

    from hybrid.train import stages as stages_mod

    wrong = replace(stages_mod.STAGES["distill"], counts=lambda cfg, ids, w: [torch.tensor(float(ids.numel())),
                                                                             torch.tensor(float(ids.numel()))])
    monkeypatch.setitem(stages_mod.STAGES._items, "distill", wrong)
    cfg = tiny_config(tmp_path / "a", tiny_teacher_dir, tiny_mask,
                      stages=[{**stage("distill", steps=1, seq_len=32, batch_size=4), "micro_batch_size": 2}])
    with pytest.raises(RuntimeError, match="weighed wrongly"):
        run(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("st,micro", [(stage("distill", seq_len=64, batch_size=4), 2),
                                      (stage("long_distill", seq_len=128, batch_size=2, kl_positions=64), 1)],
                         ids=["distill", "long_distill"])
def test_a_split_step_on_cuda_with_the_compiled_student_and_the_fused_loss(tmp_path, tiny_teacher_dir, tiny_mask,
                                                                           monkeypatch, st, micro):
    """Where the recipes split stages 2 and 3: CUDA, the compiled student, the fused loss (on for CUDA batches) and
    the bf16 compiled teacher (for long_distill on each row's first kl_positions alone). The split step's gradient
    is the one-pass gradient, to the compiled kernels' rounding."""
    assert torch.cuda.is_available(), "a gpu test: run it with -m gpu on a machine with CUDA"
    kw = dict(device="cuda", compile=True, teacher_dtype="bfloat16", compile_teacher=True)
    grads = []
    for name, micro in (("one", 0), ("split", micro)):
        folder = tmp_path / name
        grads.append(_first_step_grads(folder, tiny_teacher_dir, tiny_mask, {**st, "micro_batch_size": micro},
                                          monkeypatch, **kw))
    one, split = grads
    assert len(one) == len(split) > 0
    num = sum(float((a - b).float().pow(2).sum()) for a, b in zip(one, split)) ** 0.5
    den = sum(float(a.float().pow(2).sum()) for a in one) ** 0.5
    assert den > 0 and num / den < 2e-3, num / den
