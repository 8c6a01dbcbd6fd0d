"""The "distill_on_policy" stage: the student continues each row itself, the KL to the teacher counts on its own
tokens too; config checks, the loss's parts, a short run that resumes bit-identical."""
from __future__ import annotations

import pytest
import torch

from hybrid.train import TrainConfig, run
from hybrid.train.config import TrainConfigError
from train_factories import stage, tiny_config


def on_policy(steps=4, seq_len=32, tokens=8, **kw):
    return stage("distill_on_policy", steps=steps, seq_len=seq_len, on_policy_tokens=tokens, **kw)


@pytest.mark.parametrize("bad,match", [
    (dict(tokens=0), r"on_policy_tokens=0: the student's own tokens per row"),
    (dict(tokens=32), r"on_policy_tokens=32: .* \[1, 32\)"),
    (dict(kl_weight=0.0), r"kl_weight=0.0: the on-policy stage learns from the KL"),
    (dict(sample_temperature=-1.0), r"sample_temperature=-1.0: must be >= 0"),
])
def test_bad_on_policy_settings_are_refused(tmp_path, tiny_teacher_dir, tiny_mask, bad, match):
    with pytest.raises(TrainConfigError, match=match):
        tiny_config(tmp_path, tiny_teacher_dir, tiny_mask, stages=[on_policy(**bad)])


def test_on_policy_tokens_belong_to_the_on_policy_stage_and_keep_old_fingerprints(tmp_path, tiny_teacher_dir,
                                                                                  tiny_mask):
    with pytest.raises(TrainConfigError, match=r"stages\[distill\]\.on_policy_tokens=8: an option of"):
        tiny_config(tmp_path, tiny_teacher_dir, tiny_mask, stages=[stage("distill", on_policy_tokens=8)])
    cfg = tiny_config(tmp_path, tiny_teacher_dir, tiny_mask, stages=[stage("align"), stage("distill")])
    assert all("on_policy_tokens" not in s and "sample_temperature" not in s for s in cfg.to_dict()["stages"])
    mixed = tiny_config(tmp_path, tiny_teacher_dir, tiny_mask, stages=[stage("align"), on_policy()])
    assert mixed.to_dict()["stages"][1]["on_policy_tokens"] == 8 and TrainConfig.from_dict(mixed.to_dict()) == mixed


def test_the_loss_counts_the_kl_on_the_students_own_tokens(tiny_teacher_dir, tiny_mask):
    """KL over every position = the logged parts (own tokens + corpus part) together; the continuation is the
    student's greedy one at temperature 0, a function of the batch (the same twice), and the CE sees the corpus
    part only."""
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM

    from headscope.mask import HeadMask
    from hybrid.convert import from_mask
    from hybrid.train.config import StageConfig
    from hybrid.train.stages import STAGES, student_continuation

    teacher = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir).eval()
    student = from_mask(teacher, HeadMask.from_json(tiny_mask)).train()
    torch.manual_seed(0)
    ids = torch.randint(5, 4000, (2, 24))  # [B, T]
    w = torch.ones_like(ids, dtype=torch.float32)
    for temp in (0.0, 1.0):
        cfg = StageConfig(name="distill_on_policy", steps=1, lr=1e-3, seq_len=24, on_policy_tokens=6,
                          sample_temperature=temp)
        a = student_continuation(cfg, student, ids[:, :18], nullcontext())  # [B, 6]
        assert a.shape == (2, 6) and torch.equal(a, student_continuation(cfg, student, ids[:, :18], nullcontext()))
        if temp == 0.0:
            with torch.no_grad():
                ref = student.generate(ids[:, :18], attention_mask=torch.ones_like(ids[:, :18]), max_new_tokens=6,
                                       do_sample=False, static_cache=False)[:, 18:]
            assert torch.equal(a, ref)
    assert student.training  # sampled in eval mode, then left in the mode it was in
    terms = {name: (wt, total, count) for name, wt, total, count in
             STAGES["distill_on_policy"].loss(cfg, student, teacher, ids, w, nullcontext())}
    assert set(terms) == {"kl", "kl_own", "kl_corpus", "ce"}
    assert terms["kl_own"][0] == 0.0 and terms["kl_corpus"][0] == 0.0 and terms["kl"][0] == 1.0
    assert terms["kl_own"][2] == 2 * 7 and terms["kl_corpus"][2] == 2 * 17  # positions 17..23 predict own tokens
    torch.testing.assert_close(terms["kl_own"][1] + terms["kl_corpus"][1], terms["kl"][1].detach())
    assert terms["ce"][2] == 2 * 17  # targets 1..17: the corpus part only
    assert terms["kl"][1].requires_grad and not terms["kl_own"][1].requires_grad


def test_a_short_on_policy_run_trains_and_resumes_bit_identical(tmp_path, tiny_teacher_dir, tiny_mask):
    stages = [stage("align", steps=2, seq_len=32), on_policy(steps=4)]
    full = run(tiny_config(tmp_path / "a", tiny_teacher_dir, tiny_mask, stages=stages, calibrate_merge=False))
    logged = [r for r in full.history if r.get("stage") == "distill_on_policy" and "loss" in r]
    assert len(logged) == 4 and all(r["loss_kl_own"] >= 0 and r["loss_kl_corpus"] >= 0 for r in logged)

    class Stop(RuntimeError):
        pass

    def stop(name, done):
        if name == "distill_on_policy" and done == 3:
            raise Stop

    cfg = tiny_config(tmp_path / "b", tiny_teacher_dir, tiny_mask, stages=stages, calibrate_merge=False,
                      checkpoint_every=2, keep_checkpoints=1)
    with pytest.raises(Stop):
        run(cfg, on_step=stop)
    resumed = run(cfg, resume=True).model.state_dict()
    for k, v in full.model.state_dict().items():
        assert torch.equal(resumed[k], v), k


def test_the_fused_loss_gives_the_naive_terms_on_the_same_continuation(tiny_teacher_dir, tiny_mask):
    """fused_loss='on' (the CUDA default 'auto', forced on the CPU here): the chunked KL over every position and the
    CE on the corpus part equal the naive path's (same sampled rows: the seed is the batch's)."""
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM

    from headscope.mask import HeadMask
    from hybrid.convert import from_mask
    from hybrid.train.config import StageConfig
    from hybrid.train.stages import STAGES

    teacher = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir).eval()
    student = from_mask(teacher, HeadMask.from_json(tiny_mask)).train()
    torch.manual_seed(1)
    ids = torch.randint(5, 4000, (2, 24))  # [B, T]
    w = torch.rand(2, 24)  # [B, T]
    terms = {}
    for mode in ("off", "on"):
        cfg = StageConfig(name="distill_on_policy", steps=1, lr=1e-3, seq_len=24, on_policy_tokens=6,
                          fused_loss=mode)
        terms[mode] = {n: (wt, t, c) for n, wt, t, c in STAGES["distill_on_policy"].loss(cfg, student, teacher, ids,
                                                                                          w, nullcontext())}
    assert set(terms["on"]) == {"kl", "ce"}
    for name in ("kl", "ce"):
        torch.testing.assert_close(terms["on"][name][1], terms["off"][name][1], rtol=1e-4, atol=1e-4)
        assert float(terms["on"][name][2]) == pytest.approx(float(terms["off"][name][2]))
    assert float(terms["off"]["ce"][2]) == pytest.approx(float(w[:, :17].sum()))  # targets 1..17 only


@pytest.mark.e2e  # two whole runs, one compiled (~40 s): CI's second lane
def test_a_compiled_student_samples_and_trains_as_the_eager_one(tmp_path, tiny_teacher_dir, tiny_mask):
    """compile = true (the GPU recipes' setting): the compiled decoder layers also run the sampling's prefill and
    decode steps; the losses follow the eager run's (greedy sampling, so the same continuations)."""
    stages = [on_policy(steps=2, sample_temperature=0.0)]
    eager = run(tiny_config(tmp_path / "e", tiny_teacher_dir, tiny_mask, stages=stages))
    comp = run(tiny_config(tmp_path / "c", tiny_teacher_dir, tiny_mask, stages=stages, compile=True))
    got = [[r[k] for k in ("loss", "loss_kl_own")] for r in comp.history if r.get("stage") == "distill_on_policy"
           and "loss" in r]
    want = [[r[k] for k in ("loss", "loss_kl_own")] for r in eager.history if r.get("stage") == "distill_on_policy"
            and "loss" in r]
    assert len(got) == 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-3, atol=1e-4)
