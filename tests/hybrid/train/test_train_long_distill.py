"""The "long_distill" stage (stage 3): the KL to the teacher on each row's first kl_positions positions, where the
teacher runs, plus the CE on every position; config checks, the loss's parts, its counts, a short run."""
from __future__ import annotations

import json
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from hybrid.train import StageConfig, TrainConfig, TrainConfigError, run
from train_factories import save_mask, save_tiny_teacher, stage, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def long_distill(steps=3, seq_len=128, batch_size=2, **kw) -> dict:
    return stage("long_distill", steps=steps, seq_len=seq_len, batch_size=batch_size, **kw)


@pytest.fixture(scope="module")
def models(tiny_teacher_dir, tiny_mask):
    """(teacher, a fresh hybrid of it), the tiny teacher of 4096 positions."""
    from transformers import AutoModelForCausalLM

    from headscope.mask import HeadMask
    from hybrid.convert import from_mask

    teacher = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir).eval()
    torch.manual_seed(0)
    student = from_mask(teacher, HeadMask.from_json(tiny_mask)).train()
    return teacher, student


@pytest.fixture(scope="module")
def short_teacher(tmp_path_factory, ref_tokenizer):
    """(teacher folder, mask): a tiny teacher of 64 positions, for rows past them."""
    folder = save_tiny_teacher(tmp_path_factory.mktemp("teacher64"), ref_tokenizer, max_position_embeddings=64)
    return folder, save_mask(folder, tmp_path_factory.mktemp("mask64") / "mask.json")


def _batch(B=2, T=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 4000, (B, T), generator=g)  # [B, T]
    w = torch.rand(B, T, generator=g)  # [B, T]: uneven weights, as task rows give
    return ids, w


def test_a_toml_stage_loads_round_trips_and_keeps_old_fingerprints(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('''
out = "runs/x"
mask = "mask.json"
[[stages]]
name = "distill"
steps = 5
lr = 5e-4
seq_len = 128
[[stages]]
name = "long_distill"
steps = 5
lr = 5e-5
seq_len = 512
kl_weight = 1.0
ce_weight = 0.2
kl_positions = 256
''')
    cfg = TrainConfig.from_file(f)
    s = cfg.stages[1]
    assert (s.name, s.kl_positions, s.kl_weight, s.ce_weight) == ("long_distill", 256, 1.0, 0.2)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["stages"][1]["kl_positions"] == 256
    assert "kl_positions" not in cfg.to_dict()["stages"][0]  # the default leaves the older stages' dicts as they were
    assert cfg.fingerprint() != cfg.replace(stages=(cfg.stages[0], StageConfig(**{**cfg.to_dict()["stages"][1],
                                                                                  "kl_positions": 128}))).fingerprint()


@pytest.mark.parametrize("bad,match", [
    (long_distill(kl_positions=-1), r"stages\[long_distill\]\.kl_positions=-1: must be an int >= 0"),
    (long_distill(kl_positions=1.5), r"kl_positions=1.5: must be an int >= 0"),
    (long_distill(kl_positions=True), r"kl_positions=True: must be an int >= 0"),
    (stage("long", kl_positions=64), r"stages\[long\]\.kl_positions=64: an option of the 'long_distill' stage"),
    (long_distill(fused_loss="on"), r"fused_loss='on': the fused loss is a 'distill' option"),
])
def test_bad_long_distill_settings_are_refused(bad, match):
    with pytest.raises(TrainConfigError, match=match):
        StageConfig(**bad)


def test_the_long_factor_applies_to_long_distill():
    d = {"out": "/tmp/x", "mask": "m.json"}
    with pytest.raises(TrainConfigError, match=r"stages\[long_distill\]\.seq_len=128: stage 3 \('long_distill'\) "
                                               r"must train at >= 4x .* seq_len >= 256"):
        TrainConfig.from_dict({**d, "stages": [stage("distill"), long_distill(seq_len=128)]})
    assert TrainConfig.from_dict({**d, "stages": [stage("distill"), long_distill(seq_len=256)]}).stages[1].seq_len == 256


def test_at_p_at_least_t_the_loss_is_distills_naive_loss(models):
    """kl_positions >= T (here 0: the teacher's 4096 positions): the KL over every position, the same terms, sums,
    counts and gradients as distill's loss on the full logits."""
    from hybrid.train.stages import STAGES

    teacher, student = models
    ids, w = _batch()
    got = {}
    for name, extra in (("distill", {"fused_loss": "off"}), ("long_distill", {})):
        cfg = StageConfig(name=name, steps=1, lr=1e-3, seq_len=48, **extra)
        student.zero_grad(set_to_none=True)
        terms = STAGES[name].loss(cfg, student, teacher, ids, w, nullcontext())
        sum(wt * total / count for _, wt, total, count in terms).backward()
        got[name] = ([(n, wt, total.detach(), count) for n, wt, total, count in terms],
                     [p.grad.clone() for p in student.parameters() if p.grad is not None])
    (a, ga), (b, gb) = got["distill"], got["long_distill"]
    assert [n for n, *_ in b] == ["kl", "ce"] and [(n, wt) for n, wt, *_ in a] == [(n, wt) for n, wt, *_ in b]
    for (_, _, ta, ca), (_, _, tb, cb) in zip(a, b):
        assert torch.equal(ta, tb) and torch.equal(ca, cb)
    assert len(ga) == len(gb) > 0 and all(torch.equal(x, y) for x, y in zip(ga, gb))


class _Diverged(nn.Module):
    """The teacher's logits up to position P, noise added after it: a student identical to the teacher on the first
    P positions of every row, whatever follows."""

    def __init__(self, model: nn.Module, P: int):
        super().__init__()
        self.model, self.P = model, P

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
        g = torch.Generator().manual_seed(1)
        noise = 5 * torch.randn(logits.shape, generator=g)  # [B, T, V]
        noise[:, : self.P] = 0
        return SimpleNamespace(logits=logits + noise)


def test_the_kl_counts_on_the_first_p_positions_alone_and_the_teacher_reads_only_them(models):
    from hybrid.train.stages import STAGES, kl_positions, long_distill_counts, with_kl_positions

    teacher, _ = models
    ids, w = _batch(T=48)
    seen = []
    hook = teacher.register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)),
                                             with_kwargs=True)
    cfg = StageConfig(name="long_distill", steps=1, lr=1e-3, seq_len=48, kl_positions=20)
    far = StageConfig(name="long_distill", steps=1, lr=1e-3, seq_len=48, kl_positions=30)
    try:
        with torch.no_grad():
            terms = {n: (wt, total, count) for n, wt, total, count in
                     STAGES["long_distill"].loss(cfg, _Diverged(teacher, 20), teacher, ids, w, nullcontext())}
            past = {n: total for n, _, total, _ in
                    STAGES["long_distill"].loss(far, _Diverged(teacher, 20), teacher, ids, w, nullcontext())}
    finally:
        hook.remove()
    # each loss: the teacher on ids[:, :P] alone, then the student (the teacher inside _Diverged) on the whole row
    assert seen == [(2, 20), (2, 48), (2, 30), (2, 48)]
    assert float(terms["kl"][1]) == pytest.approx(0.0, abs=1e-4) and float(terms["kl"][2]) == 2 * 20
    assert float(past["kl"]) > 1.0  # the 10 positions past 20 differ: counted when P = 30
    assert float(terms["ce"][2]) == pytest.approx(float(w[:, :-1].sum()))  # the CE on every position
    # the counts without a model: B * min(P, T) and the weights; P = 0 resolved to the teacher's positions first
    assert [float(c) for c in long_distill_counts(cfg, ids, w)] == pytest.approx([40.0, float(w[:, :-1].sum())])
    default = StageConfig(name="long_distill", steps=1, lr=1e-3, seq_len=48)
    with pytest.raises(ValueError, match="with_kl_positions"):
        long_distill_counts(default, ids, w)
    assert kl_positions(default, teacher) == with_kl_positions(default, teacher).kl_positions == 4096
    assert [float(c) for c in long_distill_counts(with_kl_positions(default, teacher), ids, w)][0] == 2 * 48
    with pytest.raises(TrainConfigError, match=r"kl_positions=5000: the teacher has 4096 positions"):
        kl_positions(StageConfig(name="long_distill", steps=1, lr=1e-3, seq_len=48, kl_positions=5000), teacher)


def test_the_kl_part_is_distills_kl_on_the_rows_first_p_tokens(models):
    """A causal student's first P logits of a T-token row are its logits on the P-token prefix: the KL term equals
    distill's KL on ids[:, :P], the CE term is the CE of the whole row."""
    from hybrid.train.losses import weighted_ce
    from hybrid.train.stages import STAGES

    teacher, student = models
    ids, w = _batch(T=48)
    with torch.no_grad():
        cfg = StageConfig(name="long_distill", steps=1, lr=1e-3, seq_len=48, kl_positions=16)
        got = {n: (total, count) for n, _, total, count in
               STAGES["long_distill"].loss(cfg, student, teacher, ids, w, nullcontext())}
        ref = StageConfig(name="distill", steps=1, lr=1e-3, seq_len=16, fused_loss="off", ce_weight=0.0)
        (_, _, kl, n), = STAGES["distill"].loss(ref, student, teacher, ids[:, :16], w[:, :16], nullcontext())
        ce, m = weighted_ce(student(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids, w)
    torch.testing.assert_close(got["kl"][0], kl, rtol=1e-5, atol=1e-6)
    assert float(got["kl"][1]) == float(n) == 2 * 16
    torch.testing.assert_close(got["ce"][0], ce, rtol=1e-5, atol=1e-6)
    assert float(got["ce"][1]) == pytest.approx(float(m))


def test_a_short_run_past_the_teachers_positions(tmp_path, short_teacher):
    """Stages 1-2 at 32 tokens, then long_distill at 128 past the teacher's 64 positions: kl_positions left at 0 is
    the teacher's 64 (logged at the stage's start), both terms are logged, the checkpoint names the stage; a
    kl_positions past the teacher's is refused before anything trains."""
    teacher, mask = short_teacher
    stages = [stage("align", steps=2, seq_len=32), stage("distill", steps=2, seq_len=32),
              long_distill(steps=3, seq_len=128, batch_size=2)]
    res = run(tiny_config(tmp_path / "a", teacher, mask, stages=stages, calibrate_merge=False))
    log = [json.loads(l) for l in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    start = [r for r in log if r.get("event") == "stage_start" and r["stage"] == "long_distill"]
    assert len(start) == 1 and start[0]["kl_positions"] == 64 and start[0]["seq_len"] == 128
    assert all("kl_positions" not in r for r in log if r.get("event") == "stage_start" and r["stage"] != "long_distill")
    rows = [r for r in res.history if r.get("stage") == "long_distill" and "loss" in r]
    assert len(rows) == 3 and all(r["seq_len"] == 128 and r["loss_kl"] > 0 and r["loss_ce"] > 0 for r in rows)
    assert all(r["loss"] == pytest.approx(r["loss_kl"] + 0.2 * r["loss_ce"], rel=1e-5) for r in rows)
    assert any(p.name.startswith("s3-long_distill-") for p in (tmp_path / "a" / "checkpoints").iterdir())
    too_far = [*stages[:2], long_distill(steps=1, seq_len=128, kl_positions=96)]
    with pytest.raises(TrainConfigError, match=r"kl_positions=96: the teacher has 64 positions"):
        run(tiny_config(tmp_path / "b", teacher, mask, stages=too_far))
    assert not (tmp_path / "b" / "log.jsonl").exists()  # refused before the run folder was made
