from __future__ import annotations

import pytest

from hybrid.train import StageConfig, TrainConfig, TrainConfigError
from train_factories import stage


def base(**kw) -> dict:
    d = {"out": "/tmp/x", "mask": "m.json", "stages": [stage("align"), stage("distill"),
                                                       stage("long", seq_len=256)]}
    d.update(kw)
    return d


def test_toml_file_round_trip(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('''
out = "runs/x"
mask = "mask.json"
seed = 3
[data]
text = 1.0
niah = 0.5
[hybrid]
merge = "norm"
[[stages]]
name = "align"
steps = 10
lr = 1e-3
seq_len = 128
[[stages]]
name = "distill"
steps = 5
lr = 5e-4
seq_len = 128
temperature = 2.0
betas = [0.9, 0.99]
[stages.data]
reasoning = 1.0
[[stages]]
name = "long"
steps = 5
lr = 1e-4
seq_len = 512
''')
    cfg = TrainConfig.from_file(f)
    assert [s.name for s in cfg.stages] == ["align", "distill", "long"]
    assert cfg.seed == 3 and cfg.data.niah == 0.5 and cfg.hybrid == {"merge": "norm"}
    assert cfg.stages[1].betas == (0.9, 0.99) and cfg.stages[1].data.reasoning == 1.0
    assert cfg.data_for(cfg.stages[0]) is cfg.data and cfg.data_for(cfg.stages[1]) is cfg.stages[1].data
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.fingerprint() == cfg.replace(out="elsewhere", device="cpu").fingerprint()  # bookkeeping only
    assert cfg.fingerprint() != cfg.replace(seed=4).fingerprint()


def test_older_field_names_are_read_and_keep_the_fingerprint():
    """calibrate_fusion / [hybrid] fusion, the older names of calibrate_merge / merge, configure the same run with
    the same fingerprint (a run made under them resumes), which is hashed under the older names."""
    import hashlib
    import json

    old = TrainConfig.from_dict(base(calibrate_fusion=False, hybrid={"fusion": "none", "gdn_conv": True}))
    new = TrainConfig.from_dict(base(calibrate_merge=False, hybrid={"merge": "none", "gdn_conv": True}))
    assert old == new and not new.calibrate_merge and new.hybrid == {"merge": "none", "gdn_conv": True}
    assert old.fingerprint() == new.fingerprint() != new.replace(calibrate_merge=True).fingerprint()
    ignore = ("out", "device", "threads", "progress", "log_every", "distributed", "compile", "compile_teacher")
    d = {k: v for k, v in new.to_dict().items() if k not in ignore and k not in ("working_dtype", "teacher_dtype")}
    d["calibrate_fusion"] = d.pop("calibrate_merge")
    d["hybrid"] = {"fusion": "none", "gdn_conv": True}
    d["stages"] = [{k: v for k, v in s.items() if k != "fused_loss"} for s in d["stages"]]
    assert new.fingerprint() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    with pytest.raises(TrainConfigError, match="both calibrate_merge=True and its older name calibrate_fusion=False"):
        TrainConfig.from_dict(base(calibrate_merge=True, calibrate_fusion=False))
    with pytest.raises(TrainConfigError, match="both merge='norm' and its older name fusion='none'"):
        TrainConfig.from_dict(base(hybrid={"merge": "norm", "fusion": "none"}))


@pytest.mark.parametrize("patch,match", [
    ({"bogus": 1}, r"unknown field\(s\) \['bogus'\]"),
    ({"data": {"txet": 1.0}}, r"data: unknown field\(s\) \['txet'\]"),
    ({"stages": [{"name": "align", "steps": 1, "lr": 1e-3, "sequence_length": 64}]}, "sequence_length"),
    ({"stages": [stage("align", lr=-1e-3)]}, r"stages\[align\]\.lr=-0.001: the learning rate must be > 0"),
    ({"stages": [stage("align"), stage("long", seq_len=128)]}, r"stages\[long\]\.seq_len=128: stage 3"),
    ({"stages": [stage("distill", seq_len=256), stage("long", seq_len=512)]}, r"seq_len >= 1024"),
    ({"stages": [stage("nope")]}, r"stages\[nope\]\.name='nope': not a registered stage"),
    ({"stages": [stage("align", steps=0)]}, r"steps=0: must be a positive int"),
    ({"stages": [stage("distill", temperature=0)]}, "temperature"),
    ({"stages": [stage("align", head_drop=0.1)]}, "head_drop"),
    ({"stages": [stage("align"), stage("pretrain")]}, "not both"),
    ({"mask": None}, r"run\.mask=None"),
    ({"data": {"text": -1.0}}, r"data\.text=-1.0"),
    ({"data": {"text": 0, "niah": 0, "multikey": 0, "reasoning": 0, "copy": 0}}, "sum to 0"),
    ({"hybrid": {"fusoin": "norm"}}, "fusoin"),
    ({"device": "tpu"}, r"run\.device='tpu'"),
    ({"eval": "nope"}, "not a registered evaluation"),
    ({"stages": []}, "at least one"),
    ({"stages": [stage("align", schedule="linear")]}, r"stages\[align\]\.schedule='linear': must be one of"),
    ({"stages": [stage("align", schedule="constant", decay_steps=5)]}, r"decay_steps=5: a constant schedule"),
    ({"stages": [stage("distill", train_gdn_qkv=False)]}, r"train_gdn_qkv=False: stage 'distill' trains every"),
    ({"stages": [stage("align", train_gdn_qkv="no")]}, r"train_gdn_qkv='no': must be true or false"),
    ({"stages": [stage("distill", train_fa_qk=True)]}, r"train_fa_qk=True: stage 'distill' trains every"),
    ({"stages": [stage("align", train_fa_qk=1)]}, r"train_fa_qk=1: must be true or false"),
    ({"stages": [stage("align", align_inputs="teachers")]}, r"align_inputs='teachers': must be one of"),
    ({"stages": [stage("distill", align_inputs="teacher")]}, r"align_inputs='teacher': stage 'distill' has no"),
])
def test_bad_configs_are_refused_naming_the_field(patch, match):
    with pytest.raises(TrainConfigError, match=match):
        TrainConfig.from_dict(base(**patch))


def test_bad_files_are_refused(tmp_path):
    with pytest.raises(TrainConfigError, match="does not exist"):
        TrainConfig.from_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("out = \n")
    with pytest.raises(TrainConfigError, match="not valid TOML"):
        TrainConfig.from_file(bad)
    other = tmp_path / "x.ini"
    other.write_text("")
    with pytest.raises(TrainConfigError, match=r"\.toml"):
        TrainConfig.from_file(other)


def test_schedule_warmup_cosine_then_constant():
    s = StageConfig(name="distill", steps=100, lr=1.0, warmup_steps=10, decay_steps=50, min_lr_ratio=0.1)
    lrs = [s.lr_at(i) for i in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear warmup
    assert all(a >= b for a, b in zip(lrs[10:60], lrs[11:61]))  # cosine decay
    assert lrs[60:] == [pytest.approx(0.1)] * 40  # then constant
    assert lrs[35] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine


def test_constant_schedule_is_warmup_then_lr_to_the_end():
    s = StageConfig(name="long", steps=100, lr=2.0, warmup_steps=4, schedule="constant")
    lrs = [s.lr_at(i) for i in range(100)]
    assert lrs[:4] == [pytest.approx(0.5), pytest.approx(1.0), pytest.approx(1.5), pytest.approx(2.0)]
    assert lrs[4:] == [2.0] * 96 and s.lr_at(10_000) == 2.0  # max_minutes: the schedule follows progress * steps
    assert StageConfig(name="long", steps=10, lr=1.0, schedule="constant").lr_at(0) == 1.0  # no warm-up
    assert StageConfig(name="long", steps=10, lr=1.0).schedule == "cosine"  # the default: existing recipes as before


def test_the_later_stage_fields_keep_the_fingerprints_of_runs_made_before_them():
    """schedule (default "cosine") and train_gdn_qkv: a config that keeps the former behaviour (cosine; align with
    train_gdn_qkv = false, as every stage 1 before the field) hashes as before the fields existed, so its runs
    resume; the new default of align (true) and a constant schedule are changes of the run."""
    import hashlib
    import json

    def former_fingerprint(cfg) -> str:  # fingerprint() as it was: to_dict() before the two fields existed
        ignore = ("out", "device", "threads", "progress", "log_every", "distributed", "compile", "compile_teacher")
        d = {k: v for k, v in cfg.to_dict().items() if k not in ignore and k not in ("working_dtype", "teacher_dtype")}
        d["stages"] = [{k: v for k, v in st.items() if k not in ("fused_loss", "schedule", "train_gdn_qkv")}
                       for st in d["stages"]]
        d["calibrate_fusion"] = d.pop("calibrate_merge")  # hashed under its older name
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    pinned = TrainConfig.from_dict(base(stages=[stage("align", train_gdn_qkv=False), stage("distill"),
                                                stage("long", seq_len=256)]))
    assert pinned.fingerprint() == former_fingerprint(pinned)
    d = pinned.to_dict()
    assert [st.get("train_gdn_qkv") for st in d["stages"]] == [False, None, None]  # kept where it has an effect
    assert not any("schedule" in st for st in d["stages"])  # the default cosine, as before
    assert TrainConfig.from_dict(d) == pinned
    new = TrainConfig.from_dict(base())  # align with the new default: trains the GDN q/k/v, another run
    assert new.to_dict()["stages"][0]["train_gdn_qkv"] is True and TrainConfig.from_dict(new.to_dict()) == new
    assert new.fingerprint() != pinned.fingerprint()
    const = TrainConfig.from_dict(base(stages=[stage("align", train_gdn_qkv=False), stage("distill"),
                                               stage("long", seq_len=256, schedule="constant")]))
    assert const.to_dict()["stages"][2]["schedule"] == "constant" and TrainConfig.from_dict(const.to_dict()) == const
    assert const.fingerprint() != pinned.fingerprint()


def test_compile_is_a_bool_not_with_fsdp_and_not_in_the_fingerprint(tmp_path):
    from hybrid.train.config import TrainConfig, TrainConfigError

    cfg = TrainConfig.from_dict({"out": str(tmp_path), "mask": "m.json",
                                 "stages": [{"name": "align", "steps": 1, "lr": 1e-3}]})
    assert cfg.compile is False
    assert cfg.replace(compile=True).fingerprint() == cfg.fingerprint()  # how it runs, not what it learns
    with pytest.raises(TrainConfigError, match="compile.*'yes'.*true or false"):
        cfg.replace(compile="yes")
    with pytest.raises(TrainConfigError, match="compile.*FSDP.*distributed = 'ddp' or compile = false"):
        cfg.replace(compile=True, distributed="fsdp")


def test_stages_and_checks_are_registries_that_refuse_a_silent_replacement():
    """A built-in stage or in-run check is replaced only with overwrite=True (a run's log then never labels another
    loss or check with a built-in's name); register_check is the trainer's own (headscope.evaluate's
    register_evaluation registers evaluation suites for any model)."""
    import dataclasses

    from headscope.registry import Registry
    from hybrid.train import CHECKS, STAGES, register_check, register_stage

    assert isinstance(STAGES, Registry) and isinstance(CHECKS, Registry) and CHECKS["none"] is None
    align, default = STAGES["align"], CHECKS["default"]
    with pytest.raises(ValueError, match="'align' is already registered in hybrid.train.STAGES: pass overwrite=True"):
        register_stage(dataclasses.replace(align, doc="mine"))
    with pytest.raises(ValueError, match="'default' is already registered in hybrid.train.CHECKS: pass overwrite=True"):
        register_check("default", lambda ctx: {})
    assert STAGES["align"] is align and CHECKS["default"] is default
    try:
        register_check("default", dict, overwrite=True)
        assert CHECKS["default"] is dict
    finally:
        register_check("default", default, overwrite=True)
    register_check("mine_test", lambda ctx: {"x": 1.0})
    try:
        assert TrainConfig.from_dict(base(eval="mine_test")).eval == "mine_test"
    finally:
        CHECKS.unregister("mine_test")
    with pytest.raises(TypeError, match="not callable"):
        register_check("bad_test", 3)
