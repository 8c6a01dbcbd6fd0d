"""hybrid.train.precision: bf16 working weights with float32 masters, alone and in the trainer."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hybrid.train import latest_checkpoint, run
from hybrid.train.precision import MasterWeights
from train_factories import stage, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, two names
        self.register_buffer("steps", torch.zeros(3, dtype=torch.long))
        self.lin.bias._no_weight_decay = True

    def forward(self, ids):  # ids [B, T]
        return self.head(self.lin(self.emb(ids)))  # [B, T, V]


def test_master_weights_cast_update_in_float32_save_the_masters_and_close_exactly():
    torch.manual_seed(0)
    model = Tied()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mw = MasterWeights(model, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.steps.dtype == torch.long
    assert model.head.weight is model.emb.weight and len(mw.params) == 3  # the tied weight once
    named = list(model.named_parameters())
    masters = mw.masters_for(named)
    assert [n for n, _ in masters] == [n for n, _ in named]
    assert all(m.dtype == torch.float32 and m.requires_grad for _, m in masters)
    assert getattr(dict(masters)["lin.bias"], "_no_weight_decay", False)  # the optimizer's groups see it
    for n, m in masters:
        assert torch.equal(m, before[n])  # exact float32 values, not the bf16 rounding
    opt = torch.optim.SGD([m for _, m in masters], lr=1e-3)
    ids = torch.randint(0, 11, (2, 5))  # [B, T]
    model(ids).float().pow(2).mean().backward()
    mw.grads_to_master()
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for _, m in masters)
    assert all(p.grad is None for p in model.parameters())  # the working copies' gradients are freed
    opt.step()
    mw.master_to_model()
    for p, m in zip(mw.params, mw.master):
        assert m.grad is None and torch.equal(p.detach(), m.to(torch.bfloat16))
    # a step smaller than bf16's spacing near the weights: the masters keep it, the working copies cannot
    assert any(not torch.equal(m, before[n]) for n, m in masters)
    state = mw.state_dict()
    assert state["head.weight"].dtype == torch.float32 and torch.equal(state["head.weight"], state["emb.weight"])
    assert state["steps"].dtype == torch.long
    mw.close()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), state[n])
    with pytest.raises(ValueError, match="float32 already"):
        MasterWeights(model, torch.float32)
    with pytest.raises(ValueError, match="'x' has no master"):
        MasterWeights(model).masters_for([("x", nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)))])


def test_updated_working_copies_reach_the_layers_inference_caches():
    """master_to_model writes the parameters in place (their versions advance), so the hybrid layers' inference
    constants (-exp(A_log), the float32 decay bias: cached by data pointer and version) follow an update: an
    evaluation after an optimizer step sees the new weights, not the first evaluation's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from headscope.mask import HeadMask
    from hybrid import from_mask

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128)
    model = from_mask(LlamaForCausalLM(cfg), HeadMask.for_model(LlamaForCausalLM(cfg), [(0, 0)]),
                      allow_degenerate=True).eval()
    mw = MasterWeights(model)
    ids = torch.randint(0, 64, (1, 12))  # [B, T]
    with torch.no_grad():
        before = model(input_ids=ids).logits.float()  # [B, T, V]; fills the inference caches
    versions = [p._version for p in mw.params]
    decay = [i for i, n in enumerate(mw.names) if n.endswith(("A_log", "dt_bias"))]
    assert decay
    with torch.no_grad():  # what AdamW's step does to the masters
        for i in decay:
            mw.master[i].add_(1.0)
    mw.master_to_model()
    assert all(p._version > v for p, v in zip(mw.params, versions))
    with torch.no_grad():
        after = model(input_ids=ids).logits.float()  # [B, T, V]
    assert not torch.equal(after, before)  # the new decay reached the layer
    mw.close()


def test_a_cast_teacher_keeps_its_rotary_frequencies_in_float32():
    """cast_parameters (teacher_dtype, the sweep's bf16 teacher): parameters in bf16, buffers such as RoPE's inv_freq
    left in float32 (model.to(bf16) would round them: angles off by radians at a few thousand positions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybrid.train.precision import cast_parameters

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg)
    inv = {n: b.clone() for n, b in model.named_buffers() if b.is_floating_point()}
    assert inv and cast_parameters(model, torch.bfloat16) is model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for n, b in model.named_buffers():
        if n in inv:
            assert b.dtype == torch.float32 and torch.equal(b, inv[n]), n


STAGES = [stage("align", steps=3, seq_len=32), stage("distill", steps=4, seq_len=32)]


def test_bf16_working_weights_train_like_float32_save_float32_and_resume_bit_identical(tmp_path, tiny_teacher_dir,
                                                                                      tiny_mask):
    """working_dtype = "bfloat16" on CPU (no autocast there: the student computes in bf16): the losses follow the
    float32 run's within bf16 rounding, checkpoints and the saved hybrid hold float32 (the masters), and a run
    killed mid-stage and resumed ends bit-identical to the uninterrupted one."""
    from safetensors.torch import load_file

    kw = dict(stages=STAGES, checkpoint_every=2, keep_checkpoints=1)
    f32 = run(tiny_config(tmp_path / "f", tiny_teacher_dir, tiny_mask, **kw))
    bf = run(tiny_config(tmp_path / "b", tiny_teacher_dir, tiny_mask, working_dtype="bfloat16", **kw))
    for name in ("align", "distill"):
        a = [r["loss"] for r in f32.history if r.get("stage") == name and "loss" in r]
        b = [r["loss"] for r in bf.history if r.get("stage") == name and "loss" in r]
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=5e-2, atol=5e-2)
        assert b != a  # and the bf16 path did run: not the float32 numbers
    assert {p.dtype for p in bf.model.parameters()} == {torch.float32}
    ck = latest_checkpoint(tmp_path / "b")
    weights = load_file(next(ck.path.glob("*.safetensors")))
    assert {t.dtype for k, t in weights.items() if t.is_floating_point()} == {torch.float32}

    class Killed(RuntimeError):
        pass

    def kill(name, done):
        if name == "distill" and done == 3:
            raise Killed

    cfg = tiny_config(tmp_path / "k", tiny_teacher_dir, tiny_mask, working_dtype="bfloat16", **kw)
    with pytest.raises(Killed):
        run(cfg, on_step=kill)
    resumed = run(cfg, resume=True).model.state_dict()
    full = bf.model.state_dict()
    for k in full:
        assert torch.equal(resumed[k], full[k]), k


def test_working_and_teacher_dtypes_are_checked_and_count_in_the_fingerprint_only_when_set(tmp_path):
    from hybrid.train.config import TrainConfig, TrainConfigError

    cfg = TrainConfig.from_dict({"out": str(tmp_path), "mask": "m.json",
                                 "stages": [{"name": "align", "steps": 1, "lr": 1e-3}]})
    assert (cfg.working_dtype, cfg.teacher_dtype, cfg.compile_teacher) == ("float32", "float32", False)
    # at their defaults the fields added later leave a run's fingerprint as it was before they existed
    d = cfg.to_dict()
    for k in ("working_dtype", "teacher_dtype"):
        d.pop(k)
    import hashlib

    d = {k: v for k, v in d.items() if k not in ("out", "device", "threads", "progress", "log_every", "distributed",
                                                 "compile", "compile_teacher")}
    d["stages"] = [{k: v for k, v in s.items() if k != "fused_loss"} for s in d["stages"]]
    d["calibrate_fusion"] = d.pop("calibrate_merge")  # hashed under its older name, as runs made with it were
    assert cfg.fingerprint() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    assert cfg.replace(working_dtype="bfloat16").fingerprint() != cfg.fingerprint()
    assert cfg.replace(teacher_dtype="bfloat16").fingerprint() != cfg.fingerprint()
    assert cfg.replace(compile_teacher=True).fingerprint() == cfg.fingerprint()  # how it runs, not what it learns
    with pytest.raises(TrainConfigError, match=r"run\.working_dtype='fp16': must be one of \['bfloat16', 'float32'\]"):
        cfg.replace(working_dtype="fp16")
    with pytest.raises(TrainConfigError, match=r"run\.teacher_dtype='half'"):
        cfg.replace(teacher_dtype="half")
    with pytest.raises(TrainConfigError, match="working_dtype.*FSDP.*working_dtype = 'float32'"):
        cfg.replace(working_dtype="bfloat16", distributed="fsdp")
    with pytest.raises(TrainConfigError, match="compile_teacher.*'fsdp'"):
        cfg.replace(compile_teacher=True, distributed="fsdp")
    with pytest.raises(TrainConfigError, match="compile_teacher=1: must be true or false"):
        cfg.replace(compile_teacher=1)
    pre = TrainConfig.from_dict({"out": str(tmp_path), "stages": [{"name": "pretrain", "steps": 1, "lr": 1e-3}]})
    with pytest.raises(TrainConfigError, match="teacher_dtype.*only the hybrid stages"):
        pre.replace(teacher_dtype="bfloat16")


def test_a_bf16_teacher_runs_the_losses(tmp_path, tiny_teacher_dir, tiny_mask):
    """teacher_dtype = "bfloat16": the teacher's weights are cast once (after the student copied them in float32)
    and the run trains; the student's own weights stay float32."""
    from hybrid.train.trainer import Trainer

    cfg = tiny_config(tmp_path / "t", tiny_teacher_dir, tiny_mask, teacher_dtype="bfloat16",
                      stages=[stage("distill", steps=2, seq_len=32)])
    tr = Trainer(cfg)
    res = tr.run("all", resume=False, allow_config_change=False)
    assert {p.dtype for p in tr.teacher.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in tr.teacher.buffers() if b.is_floating_point()} <= {torch.float32}  # RoPE's inv_freq
    assert {p.dtype for p in res.model.parameters()} == {torch.float32}
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in res.history if "loss" in r)


@pytest.mark.slow  # torch.compile on CPU: inductor for the tiny teacher's layers
def test_compile_teacher_runs_the_losses_on_a_compiled_copy(tmp_path, tiny_teacher_dir, tiny_mask):
    from hybrid.train.build import compiled_submodules
    from hybrid.train.trainer import Trainer

    stages = [stage("distill", steps=2, seq_len=32)]
    eager = run(tiny_config(tmp_path / "e", tiny_teacher_dir, tiny_mask, stages=stages))
    tr = Trainer(tiny_config(tmp_path / "c", tiny_teacher_dir, tiny_mask, stages=stages, compile_teacher=True))
    comp = tr.run("all", resume=False, allow_config_change=False)
    assert tr.loss_teacher is not tr.teacher and compiled_submodules(tr.loss_teacher)
    assert not compiled_submodules(tr.teacher)  # text sampling keeps the eager teacher
    a = [r["loss"] for r in eager.history if "loss" in r]
    b = [r["loss"] for r in comp.history if "loss" in r]
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_bf16_working_weights_on_cuda_follow_the_float32_run(tmp_path, ref_tokenizer):
    """On the GPU (autocast bf16, fla's GDN kernels, head dim 64): bf16 working weights with a bf16 teacher give the
    float32-weights run's losses within bf16 rounding, and the trained hybrid comes back in float32."""
    from train_factories import save_mask, save_tiny_teacher

    teacher = save_tiny_teacher(tmp_path / "t", ref_tokenizer, head_dim=64)
    mask = save_mask(teacher, tmp_path / "mask.json")
    stages = [stage("align", steps=4, seq_len=128), stage("distill", steps=4, seq_len=128)]
    f32 = run(tiny_config(tmp_path / "f", teacher, mask, stages=stages, device="cuda"))
    bf = run(tiny_config(tmp_path / "b", teacher, mask, stages=stages, device="cuda", working_dtype="bfloat16",
                         teacher_dtype="bfloat16"))
    for name in ("align", "distill"):
        a = [r["loss"] for r in f32.history if r.get("stage") == name and "loss" in r]
        b = [r["loss"] for r in bf.history if r.get("stage") == name and "loss" in r]
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=5e-2, atol=5e-2)
    assert {p.dtype for p in bf.model.parameters()} == {torch.float32}
