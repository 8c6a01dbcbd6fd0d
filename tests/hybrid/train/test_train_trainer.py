from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from hybrid.train import CheckpointError, TrainConfig, latest_checkpoint, run
from hybrid.train.trainer import CheckpointAndStop
from train_factories import save_mask, save_tiny_teacher, stage, tiny_config


class Killed(RuntimeError):
    pass


def kill_at(stage_name: str, step: int):
    def hook(name, done):
        if name == stage_name and done == step:
            raise Killed(f"killed after {name} step {done}")
    return hook


def losses(history, name):
    return [r["loss"] for r in history if r.get("stage") == name and "loss" in r]


def test_smoke_three_stages_losses_go_down_and_the_saved_hybrid_reloads(tmp_path, tiny_teacher_dir, tiny_mask):
    from transformers import AutoModelForCausalLM

    from headscope.mask import HeadMask

    t0 = time.time()
    # calibrate_merge off: the machinery is under test here, losses falling from a hybrid that starts away from
    # its teacher; calibrated, the hybrid of this random tiny teacher starts at KL 0.005 and the stage-2 loss is
    # the CE noise of the batches (test_a_fresh_hybrid_starts_with_the_teachers_head_scales covers calibration)
    cfg = tiny_config(tmp_path / "out", tiny_teacher_dir, tiny_mask, eval="default", eval_samples=2,
                      calibrate_merge=False,
                      stages=[stage("align", steps=6, seq_len=32, lr=1e-2), stage("distill", steps=6, seq_len=32),
                              stage("long", steps=6, seq_len=128, batch_size=1)])
    res = run(cfg)
    for name in ("align", "distill", "long"):
        ls = losses(res.history, name)
        assert len(ls) == 6 and sum(ls[-2:]) < sum(ls[:2]), (name, ls)
    evals = [r for r in res.history if "eval_heldout_loss" in r]
    assert [r["stage"] for r in evals] == ["align", "distill", "long"]
    # the long stage is also checked at the first stage's length (on the distill check's windows)
    assert [r.get("heldout_base_len") for r in evals] == [None, None, 32]
    assert 0 < evals[2]["eval_heldout_loss_base"] < 20
    assert (tmp_path / "out" / "training.html").exists()
    log = [json.loads(l) for l in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert {"lr", "tok_per_s", "grad_norm", "loss"} <= set([r for r in log if "event" not in r][0])
    assert [r["stage"] for r in log if r.get("event") == "warmup_step"] == ["align", "distill", "long"]
    reloaded = AutoModelForCausalLM.from_pretrained(res.model_path)
    assert HeadMask.from_dict(reloaded.config.head_mask) == HeadMask.from_json(tiny_mask)
    ids = torch.randint(0, 4000, (1, 40))
    torch.testing.assert_close(reloaded(input_ids=ids).logits, res.model.eval()(input_ids=ids).logits,
                               rtol=0, atol=0)
    assert time.time() - t0 < 60


SHORT = [stage("align", steps=3, seq_len=32), stage("distill", steps=4, seq_len=32),
         stage("long", steps=2, seq_len=128, batch_size=1)]


@pytest.mark.parametrize("where,resumes_from", [(("distill", 3), "s2-distill-000002"),  # mid-stage
                                                (("align", 3), "s1-align-000003"),  # right after a stage end
                                                (("long", 1), "s2-distill-000004")])  # before a checkpoint
def test_killed_and_resumed_run_ends_bit_identical(tmp_path, tiny_teacher_dir, tiny_mask, where, resumes_from):
    kw = dict(stages=SHORT, checkpoint_every=2, keep_checkpoints=1)
    full = run(tiny_config(tmp_path / "a", tiny_teacher_dir, tiny_mask, **kw)).model.state_dict()
    cfg = tiny_config(tmp_path / "b", tiny_teacher_dir, tiny_mask, **kw)
    with pytest.raises(Killed):
        run(cfg, on_step=kill_at(*where))
    ck = latest_checkpoint(tmp_path / "b")
    assert ck.path.name == resumes_from
    resumed = run(cfg, resume=True).model.state_dict()
    assert resumed.keys() == full.keys()
    for k in full:
        assert torch.equal(resumed[k], full[k]), k
    lines = [json.loads(l) for l in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert any(l.get("event") == "resume" for l in lines)


def test_checkpoint_and_stop_checkpoints_that_very_step_and_resumes_bit_identical(tmp_path, tiny_teacher_dir,
                                                                                  tiny_mask):
    """An on_step callback that raises CheckpointAndStop between periodic checkpoints (a time limit): the trainer
    writes a checkpoint at that step first, so the resumed run trains from there and ends as if never stopped."""
    kw = dict(stages=SHORT, checkpoint_every=0, keep_checkpoints=1)  # checkpoints only at stage ends
    full = run(tiny_config(tmp_path / "a", tiny_teacher_dir, tiny_mask, **kw)).model.state_dict()
    cfg = tiny_config(tmp_path / "b", tiny_teacher_dir, tiny_mask, **kw)

    def stop(name, done):
        if (name, done) == ("distill", 3):
            raise CheckpointAndStop("time is up")

    with pytest.raises(CheckpointAndStop):
        run(cfg, on_step=stop)
    assert latest_checkpoint(tmp_path / "b").path.name == "s2-distill-000003"
    resumed = run(cfg, resume=True)
    for k, v in full.items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
    assert [r["step"] for r in resumed.history if r.get("stage") == "distill" and "loss" in r] == [4]


def test_a_run_folder_written_under_the_older_merge_names_resumes_bit_identical(tmp_path, tiny_teacher_dir,
                                                                               tiny_mask):
    """A run whose run.json and checkpoints name the merge "fusion" (its identity's hybrid options, the weights
    ...self_attn.fusion.*) and whose config says calibrate_fusion resumes: same identity, same fingerprint, same
    result as a run that was never interrupted."""
    from safetensors.torch import load_file, save_file

    kw = dict(stages=SHORT[:2], checkpoint_every=2, keep_checkpoints=1)
    full = run(tiny_config(tmp_path / "a", tiny_teacher_dir, tiny_mask, **kw)).model.state_dict()
    cfg = tiny_config(tmp_path / "b", tiny_teacher_dir, tiny_mask, **kw)
    with pytest.raises(Killed):
        run(cfg, on_step=kill_at("distill", 3))
    record = json.loads((tmp_path / "b" / "run.json").read_text())
    record["identity"]["hybrid"]["fusion"] = record["identity"]["hybrid"].pop("merge")
    record["config"]["calibrate_fusion"] = record["config"].pop("calibrate_merge")
    (tmp_path / "b" / "run.json").write_text(json.dumps(record))
    ck = latest_checkpoint(tmp_path / "b")
    weights = load_file(str(ck.path / "model.safetensors"))
    older = {k.replace(".self_attn.merge.", ".self_attn.fusion."): v for k, v in weights.items()}
    assert older.keys() != weights.keys()
    with open(ck.path / "model.safetensors", "rb") as f:  # keep the file's metadata
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    save_file(older, str(ck.path / "model.safetensors"), metadata=header.get("__metadata__"))
    older_cfg = TrainConfig.from_dict({**{k: v for k, v in cfg.to_dict().items() if k != "calibrate_merge"},
                                       "calibrate_fusion": cfg.calibrate_merge})
    resumed = run(older_cfg, resume=True).model.state_dict()
    assert resumed.keys() == full.keys()
    for k in full:
        assert torch.equal(resumed[k], full[k]), k


@pytest.mark.parametrize("train_gdn_qkv", [False, True])
def test_align_trains_the_new_parameters_and_by_default_the_gdn_qkv(tmp_path, tiny_teacher_dir, tiny_mask,
                                                                    train_gdn_qkv):
    """Stage 1 changes exactly the parameters the hybrid adds, plus (train_gdn_qkv, the default) the GDN heads'
    q/k/v copied from the teacher; never the FA heads' q/k/v, o_proj, the MLPs, norms or embeddings."""
    from headscope.reference import load_model
    from hybrid.convert import from_mask
    from hybrid.train.stages import gdn_qkv_parameter_names, new_parameter_names

    teacher, _ = load_model(str(tiny_teacher_dir))
    before = from_mask(teacher, tiny_mask).state_dict()
    res = run(tiny_config(tmp_path / "o", tiny_teacher_dir, tiny_mask,
                          stages=[stage("align", steps=3, lr=1e-2, train_gdn_qkv=train_gdn_qkv)]))
    new, qkv = new_parameter_names(res.model), gdn_qkv_parameter_names(res.model)
    assert new and not any(".mlp." in n for n in new)  # the teacher's MLP gate_proj is not new
    # Qwen3: q/k/v projections and q/k norms of every layer's GDN branch (2 layers), none of them new
    assert qkv and not qkv & new and all(".self_attn.la." in n for n in qkv)
    assert {n.rsplit(".", 2)[-2] for n in qkv} == {"q_proj", "k_proj", "v_proj", "q_norm", "k_norm"}
    after = dict(res.model.named_parameters())
    changed = {n for n, p in after.items() if not torch.equal(p.detach(), before[n])}
    assert changed == (new | qkv if train_gdn_qkv else new)
    log = [json.loads(l) for l in (tmp_path / "o" / "log.jsonl").read_text().splitlines()]
    n_trained = next(r["trainable_params"] for r in log if r.get("event") == "stage_start")
    assert n_trained == sum(after[n].numel() for n in (new | qkv if train_gdn_qkv else new))


def test_train_fa_qk_adds_the_fa_heads_q_k_to_stage_1(tmp_path, tiny_teacher_dir, tiny_mask):
    """train_fa_qk: stage 1 also changes the FA branches' q/k projections and q/k norms (not their v, o_proj or the
    MLPs); the option is left out of the config's dict (and fingerprint) when off."""
    from headscope.reference import load_model
    from hybrid.convert import from_mask
    from hybrid.train.stages import fa_qk_parameter_names, gdn_qkv_parameter_names, new_parameter_names

    teacher, _ = load_model(str(tiny_teacher_dir))
    before = from_mask(teacher, tiny_mask).state_dict()
    cfg = tiny_config(tmp_path / "o", tiny_teacher_dir, tiny_mask,
                      stages=[stage("align", steps=3, lr=1e-2, train_fa_qk=True)])
    res = run(cfg)
    fa = fa_qk_parameter_names(res.model)
    assert fa and all(".self_attn.fa." in n for n in fa) and not fa & new_parameter_names(res.model)
    assert {n.rsplit(".", 2)[-2] for n in fa} == {"q_proj", "k_proj", "q_norm", "k_norm"}
    changed = {n for n, p in res.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == new_parameter_names(res.model) | gdn_qkv_parameter_names(res.model) | fa
    assert cfg.to_dict()["stages"][0]["train_fa_qk"] is True
    off = tiny_config(tmp_path / "p", tiny_teacher_dir, tiny_mask, stages=[stage("align", steps=3, lr=1e-2)])
    assert "train_fa_qk" not in off.to_dict()["stages"][0]


@pytest.mark.parametrize("calibrate", [True, False])
def test_a_fresh_hybrid_starts_with_the_teachers_head_scales(tmp_path, tiny_teacher_dir, tiny_mask, calibrate):
    """calibrate_merge (default on): gamma = the teacher's per-head output RMS on the first stage's corpus (4
    windows of min(512, seq_len) tokens), logged; off: gamma_init (1) everywhere."""
    from headscope.reference import load_model
    from hybrid.convert import from_mask
    from hybrid.layers.merge import calibrate_merge
    from hybrid.train.text import load_corpus

    teacher, tok = load_model(str(tiny_teacher_dir))
    res = run(tiny_config(tmp_path / "o", tiny_teacher_dir, tiny_mask, calibrate_merge=calibrate,
                          stages=[stage("align", steps=1, lr=1e-12)]))
    gamma = torch.stack([layer.self_attn.merge.gamma.detach() for layer in res.model.model.layers])  # [L, H]
    log = [json.loads(line) for line in (tmp_path / "o" / "log.jsonl").read_text().splitlines()]
    events = [r for r in log if r.get("event") == "calibrate_merge"]
    if calibrate:
        want = calibrate_merge(from_mask(teacher, tiny_mask), teacher, load_corpus("heldout", tok)[:256].view(4, 64))
        torch.testing.assert_close(gamma, want.to(gamma), rtol=1e-4, atol=1e-6)
        assert len(events) == 1 and events[0]["tokens"] == 256
        assert not torch.allclose(gamma, torch.ones_like(gamma))
    else:
        assert torch.allclose(gamma, torch.ones_like(gamma)) and not events


def test_the_token_level_baseline_is_calibrated_too(tmp_path, tiny_teacher_dir, tiny_mask):
    """Study 3's token-level variant trains through the same trainer: both branch gammas start calibrated."""
    res = run(tiny_config(tmp_path / "o", tiny_teacher_dir, tiny_mask, hybrid={"granularity": "token", "window": 8},
                          stages=[stage("align", steps=1, lr=1e-12)]))
    attn = res.model.model.layers[0].self_attn
    assert not torch.allclose(attn.swa_gamma, torch.ones_like(attn.swa_gamma))
    torch.testing.assert_close(attn.swa_gamma, attn.gdn_gamma, rtol=1e-4, atol=1e-6)


def test_a_missing_plotly_costs_the_figure_not_the_run(tmp_path, tiny_teacher_dir, tiny_mask, monkeypatch):
    import hybrid.train.trainer as trainer

    def no_plotly(*a, **k):
        raise ModuleNotFoundError("No module named 'plotly'")

    monkeypatch.setattr(trainer, "plot_log", no_plotly)
    with pytest.warns(UserWarning, match="training.html.*pip install plotly"):
        res = run(tiny_config(tmp_path / "o", tiny_teacher_dir, tiny_mask, stages=[stage("align", steps=2)]))
    assert res.model_path is not None and (res.model_path / "config.json").exists()


def test_mask_for_another_model_is_refused(tmp_path, tiny_teacher_dir, ref_tokenizer):
    from headscope.mask import MaskError

    other = save_tiny_teacher(tmp_path / "other", ref_tokenizer, intermediate_size=96)  # same heads, other model
    mask = save_mask(other, tmp_path / "other_mask.json")
    with pytest.raises(MaskError, match="fingerprint"):
        run(tiny_config(tmp_path / "o", tiny_teacher_dir, mask, stages=[stage("align", steps=1)]))


def test_output_folder_rules(tmp_path, tiny_teacher_dir, tiny_mask):
    out = tmp_path / "o"
    one = [stage("align", steps=2, seq_len=32)]
    run(tiny_config(out, tiny_teacher_dir, tiny_mask, stages=one))
    # the folder of this run: a fresh start is refused, resume is allowed
    with pytest.raises(CheckpointError, match="pass --resume"):
        run(tiny_config(out, tiny_teacher_dir, tiny_mask, stages=one))
    # a different run (another mask): refused, resume or not
    other = save_mask(tiny_teacher_dir, tmp_path / "m2.json", heads=((0, 0), (1, 3)))
    for resume in (False, True):
        with pytest.raises(CheckpointError, match="belongs to a different run"):
            run(tiny_config(out, tiny_teacher_dir, other, stages=one), resume=resume)
    # a changed config: refused unless allowed
    changed = tiny_config(out, tiny_teacher_dir, tiny_mask, stages=[stage("align", steps=3, seq_len=32)])
    with pytest.raises(CheckpointError, match=r"changed config \(stages"):
        run(changed, resume=True)
    res = run(changed, resume=True, allow_config_change=True)
    assert [r["step"] for r in res.history if "loss" in r] == [3]
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        run(tiny_config(tmp_path / "empty", tiny_teacher_dir, tiny_mask, stages=one), resume=True)


def test_a_half_written_checkpoint_is_never_loaded(tmp_path, tiny_teacher_dir, tiny_mask, monkeypatch):
    import hybrid.train.checkpoint as ckmod

    cfg = tiny_config(tmp_path / "o", tiny_teacher_dir, tiny_mask, checkpoint_every=1,
                      stages=[stage("align", steps=3, seq_len=32)])
    real = ckmod.save_file
    calls = {"n": 0}

    def failing(*a, **k):  # the second checkpoint's write dies after the weights (e.g. disk full)
        calls["n"] += 1
        real(*a, **k)
        if calls["n"] == 2:
            raise OSError("No space left on device")

    monkeypatch.setattr(ckmod, "save_file", failing)
    with pytest.raises(OSError, match="No space"):
        run(cfg)
    monkeypatch.setattr(ckmod, "save_file", real)
    assert (tmp_path / "o" / "checkpoints" / ".tmp-s1-align-000002").exists()  # the debris
    ck = latest_checkpoint(tmp_path / "o")
    assert ck.step == 1  # the complete one, never the half-written one
    res = run(cfg, resume=True)
    assert [r["step"] for r in res.history if "loss" in r] == [2, 3]
    # a folder that LATEST points to but whose write never finished is refused, not loaded
    bad = tmp_path / "o" / "checkpoints" / "s1-align-000009"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"")
    (tmp_path / "o" / "checkpoints" / "LATEST").write_text(bad.name)
    with pytest.raises(CheckpointError, match="incomplete"):
        latest_checkpoint(tmp_path / "o")


def test_stage_option_runs_one_stage_after_the_earlier_ones(tmp_path, tiny_teacher_dir, tiny_mask):
    cfg = tiny_config(tmp_path / "o", tiny_teacher_dir, tiny_mask, stages=SHORT)
    with pytest.raises(CheckpointError, match="stage 1 is not finished"):
        run(cfg, stage=2)
    assert [r["stage"] for r in run(cfg, stage=1).history if "loss" in r] == ["align"] * 3
    assert {r["stage"] for r in run(cfg, stage="2").history if "loss" in r} == {"distill"}
    with pytest.raises(CheckpointError, match="already finished"):
        run(cfg, stage=2)
    with pytest.raises(ValueError, match="stages 1..3"):
        run(cfg, stage=4)


def test_the_warmup_step_is_logged_and_not_counted_in_max_minutes(tmp_path, tiny_teacher_dir, tiny_mask,
                                                                   request):
    """A first step slower than the whole budget (kernel autotuning on a bare GPU) must not end the stage."""
    import dataclasses

    from hybrid.train import stages as stages_mod

    align = stages_mod.STAGES["align"]
    calls = []

    def slow_first(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(1.5)
        return align.loss(*args, **kw)

    stages_mod.register_stage(dataclasses.replace(align, loss=slow_first), overwrite=True)
    request.addfinalizer(lambda: stages_mod.register_stage(align, overwrite=True))
    cfg = tiny_config(tmp_path / "out", tiny_teacher_dir, tiny_mask,
                      stages=[stage("align", steps=10_000, max_minutes=0.02)])  # 1.2 s budget
    with pytest.warns(UserWarning, match=r"stage align stopped by its max_minutes=0.02 at step \d+ of 10000"):
        run(cfg)
    log = [json.loads(l) for l in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    capped = [r for r in log if r.get("event") == "stage_capped"]  # a stage its time cap ended is said, and logged
    assert len(capped) == 1 and capped[0]["steps"] == 10_000 and 3 < capped[0]["step"] < 10_000
    warm = [r for r in log if r.get("event") == "warmup_step"]
    assert len(warm) == 1 and warm[0]["seconds"] >= 1.5 and warm[0]["step"] == 1
    assert warm[0]["first_batch_seconds"] >= 0  # where a slow first step's time goes: data or kernels
    starts = [r for r in log if r.get("event") == "stage_start"]
    assert {"corpus", "total"} <= set(starts[0]["setup_seconds"])
    assert [r.get("event") for r in log].count("setup") == 1
    assert len(calls) > 3  # steps ran after the warm-up inside the 1.2 s budget
    assert len(calls) < 10_000  # and the budget still ended the stage


def test_data_workers_are_spawned_and_follow_the_time_budget(tmp_path, tiny_teacher_dir, tiny_mask):
    """workers > 0: batches come from spawned processes (never fork from a CUDA process), the stage's progress
    (shared with them for the length curriculum under max_minutes) included."""
    cfg = tiny_config(tmp_path / "out", tiny_teacher_dir, tiny_mask,
                      stages=[stage("align", steps=3, max_minutes=5.0)])
    cfg = cfg.replace(data=dataclasses.replace(cfg.data, workers=1))
    assert cfg.data.workers == 1
    res = run(cfg)
    assert len(losses(res.history, "align")) == 3


def test_the_next_stages_workers_start_during_the_stage_before_and_give_the_same_batches(
        tmp_path, tiny_teacher_dir, tiny_mask, monkeypatch):
    """A stage's data workers are started after the first step of the stage before (their start-up overlaps its
    training); the batches are the same as those of workers started at the stage's own start."""
    import hybrid.train.trainer as trainer

    seen = []
    real = trainer.Trainer.start_next_workers

    def spy(self):
        seen.append((self._next["index"], self._next["batches"]) if self._next else None)
        real(self)

    monkeypatch.setattr(trainer.Trainer, "start_next_workers", spy)
    stages = [stage("align", steps=2), stage("distill", steps=2)]
    cfg = tiny_config(tmp_path / "w", tiny_teacher_dir, tiny_mask, stages=stages)
    early = run(cfg.replace(data=dataclasses.replace(cfg.data, workers=1)))
    log = [json.loads(line) for line in (early.out / "log.jsonl").read_text().splitlines()]
    starts = [r for r in log if r.get("event") == "stage_start"]
    assert [r["setup_seconds"].get("made_during_stage_before", False) for r in starts] == [False, True]
    assert seen[0] == (1, None)  # after align's first step: distill's workers start; not started before
    here = run(tiny_config(tmp_path / "h", tiny_teacher_dir, tiny_mask, stages=stages))  # workers=0: no early start
    assert losses(early.history, "distill") == pytest.approx(losses(here.history, "distill"), rel=1e-5)


@pytest.mark.slow  # torch.compile on CPU: ~1-3 min of inductor for the tiny layers
def test_compiled_student_trains_as_the_eager_one(tmp_path, tiny_teacher_dir, tiny_mask):
    """compile = true: the student's decoder layers run torch.compile'd (one `compile` event); losses follow the
    eager run's within float tolerance and the saved hybrid has the same parameter names."""
    stages = [stage("align", steps=2, seq_len=32), stage("distill", steps=2, seq_len=32)]
    eager = run(tiny_config(tmp_path / "e", tiny_teacher_dir, tiny_mask, stages=stages))
    comp = run(tiny_config(tmp_path / "c", tiny_teacher_dir, tiny_mask, stages=stages, compile=True))
    for name in ("align", "distill"):
        torch.testing.assert_close(torch.tensor(losses(comp.history, name)), torch.tensor(losses(eager.history, name)),
                                   rtol=1e-3, atol=1e-4)
    log = [json.loads(l) for l in (tmp_path / "c" / "log.jsonl").read_text().splitlines()]
    assert [l["layers"] for l in log if l.get("event") == "compile"] == [eager.model.config.num_hidden_layers]
    assert comp.model.state_dict().keys() == eager.model.state_dict().keys()
