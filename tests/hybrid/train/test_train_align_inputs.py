"""StageConfig.align_inputs: stage 1's per-layer MSE with the hybrid run end to end ("student") or with each layer
reading the teacher's input to that layer ("teacher")."""
from __future__ import annotations

import contextlib

import pytest
import torch

from train_factories import save_mask, stage, tiny_config


@pytest.fixture(scope="module")
def teacher_and_copy(tiny_teacher_dir, tmp_path_factory):
    """The tiny teacher and a hybrid with every head FA that computes what the teacher computes (RoPE kept, no log
    scale, no gate, heads concatenated as they are): a copy whose layers can be broken one at a time."""
    from headscope.reference import load_model
    from hybrid.convert import from_mask

    teacher, _ = load_model(str(tiny_teacher_dir))
    heads = [(layer, h) for layer in range(teacher.config.num_hidden_layers)
             for h in range(teacher.config.num_attention_heads)]
    mask = save_mask(tiny_teacher_dir, tmp_path_factory.mktemp("all_fa") / "mask.json", heads=heads)
    copy = from_mask(teacher, mask, fa_rope=True, fa_log_scale=False, fa_gate="none", merge="none",
                     allow_degenerate=True)
    return teacher.eval(), copy.eval()


def _align(student, teacher, ids, align_inputs: str) -> float:
    from hybrid.train.config import StageConfig
    from hybrid.train.stages import align_loss

    cfg = StageConfig(**stage("align", align_inputs=align_inputs))
    [(name, weight, total, count)] = align_loss(cfg, student, teacher, ids, None, contextlib.nullcontext())
    assert name == "mse" and weight == 1.0
    return float((total / count).detach())


def test_a_copy_of_the_teacher_has_no_alignment_loss_either_way(teacher_and_copy):
    teacher, copy = teacher_and_copy
    ids = torch.randint(0, teacher.config.vocab_size, (2, 24))  # [B, T]
    assert _align(copy, teacher, ids, "student") < 1e-9
    assert _align(copy, teacher, ids, "teacher") < 1e-9


def test_teacher_inputs_keep_a_broken_layer_from_reaching_the_layers_above(teacher_and_copy):
    """Layer 0 broken: run end to end, layer 1 reads the broken output and adds its own error; fed the teacher's
    inputs, layer 1 is exact, so the loss is layer 0's term alone, the same term as end to end."""
    from hybrid.train.losses import hidden_mse
    from hybrid.train.stages import _capture, decoder_layers

    teacher, copy = teacher_and_copy
    ids = torch.randint(0, teacher.config.vocab_size, (2, 24))  # [B, T]
    o_proj = decoder_layers(copy)[0].self_attn.o_proj.weight
    saved = o_proj.detach().clone()
    try:
        with torch.no_grad():
            o_proj.mul_(3.0)
        s_h, t_h = [], []
        with torch.no_grad(), _capture(decoder_layers(copy)[:1], s_h), _capture(decoder_layers(teacher)[:1], t_h):
            copy(input_ids=ids, use_cache=False)
            teacher(input_ids=ids, use_cache=False)
        total, count = hidden_mse(s_h, t_h)
        layer_0 = float(total / count)
        end_to_end = _align(copy, teacher, ids, "student")
        fed = _align(copy, teacher, ids, "teacher")
    finally:
        with torch.no_grad():
            o_proj.copy_(saved)
    assert layer_0 > 1e-4
    assert fed == pytest.approx(layer_0, rel=1e-5)
    assert end_to_end > 1.5 * fed  # layer 1 carries layer 0's error up


def test_teacher_inputs_give_no_gradient_across_layers(teacher_and_copy):
    """Fed the teacher's inputs, layer 0's parameters get gradient from layer 0's term only: breaking layer 1
    leaves layer 0's gradient as it was."""
    from hybrid.train.config import StageConfig
    from hybrid.train.stages import align_loss, decoder_layers

    teacher, copy = teacher_and_copy
    ids = torch.randint(0, teacher.config.vocab_size, (2, 24))  # [B, T]
    layers = decoder_layers(copy)
    cfg = StageConfig(**stage("align", align_inputs="teacher"))
    w0 = layers[0].self_attn.o_proj.weight

    def grad_of_layer_0() -> torch.Tensor:
        copy.zero_grad()
        [(_, _, total, count)] = align_loss(cfg, copy, teacher, ids, None, contextlib.nullcontext())
        (total / count).backward()
        return w0.grad.detach().clone()  # [C, C]

    saved = [p.detach().clone() for p in (w0, layers[1].self_attn.o_proj.weight)]
    try:
        with torch.no_grad():
            w0.mul_(1.5)
        before = grad_of_layer_0()
        with torch.no_grad():
            layers[1].self_attn.o_proj.weight.mul_(-2.0)
        after = grad_of_layer_0()
    finally:
        with torch.no_grad():
            w0.copy_(saved[0])
            layers[1].self_attn.o_proj.weight.copy_(saved[1])
        copy.zero_grad()
    assert before.abs().sum() > 0
    torch.testing.assert_close(after, before)


def test_a_run_trains_with_teacher_inputs_and_the_option_enters_the_fingerprint(tmp_path, tiny_teacher_dir,
                                                                                 tiny_mask):
    from hybrid.train import run

    cfg = tiny_config(tmp_path / "o", tiny_teacher_dir, tiny_mask,
                      stages=[stage("align", steps=3, lr=1e-2, align_inputs="teacher")])
    res = run(cfg)
    mse = [r["loss"] for r in res.history if r.get("stage") == "align" and "loss" in r]
    assert len(mse) == 3 and all(m == m and m > 0 for m in mse)  # finite, positive
    assert cfg.to_dict()["stages"][0]["align_inputs"] == "teacher"
    default = tiny_config(tmp_path / "p", tiny_teacher_dir, tiny_mask, stages=[stage("align", steps=3, lr=1e-2)])
    assert "align_inputs" not in default.to_dict()["stages"][0]  # runs made before the option keep their fingerprint
    assert cfg.fingerprint() != default.fingerprint()


@pytest.mark.slow  # torch.compile on CPU: ~1 min of inductor for the tiny layers
def test_teacher_inputs_with_a_compiled_student_give_the_eager_losses(tmp_path, tiny_teacher_dir, tiny_mask):
    """compile = true puts the layers' hooks inside torch.compile; the feeding hook runs outside it and the
    compiled student's stage-1 losses follow the eager one's."""
    from hybrid.train import run

    stages = [stage("align", steps=2, seq_len=32, align_inputs="teacher")]
    eager = run(tiny_config(tmp_path / "e", tiny_teacher_dir, tiny_mask, stages=stages))
    comp = run(tiny_config(tmp_path / "c", tiny_teacher_dir, tiny_mask, stages=stages, compile=True))
    own = run(tiny_config(tmp_path / "s", tiny_teacher_dir, tiny_mask, stages=[stage("align", steps=2, seq_len=32)]))
    mse = [[r["loss"] for r in res.history if r.get("stage") == "align" and "loss" in r] for res in (eager, comp, own)]
    torch.testing.assert_close(torch.tensor(mse[1]), torch.tensor(mse[0]), rtol=1e-3, atol=1e-4)
    assert abs(mse[2][0] - mse[0][0]) > 1e-3 * mse[2][0]  # fed, the first step's loss is not the end-to-end one


@pytest.mark.gpu
def test_teacher_inputs_with_a_compiled_student_on_cuda_give_the_eager_losses(tmp_path, tiny_teacher_dir, tiny_mask):
    """The same on the GPU, where the recipes run it: the compiled student (fla's GDN kernels when installed,
    else the PyTorch twins) fed the teacher's inputs follows the eager student's stage-1 losses."""
    from hybrid.train import run

    assert torch.cuda.is_available(), "a gpu test: run it with -m gpu on a machine with CUDA"
    stages = [stage("align", steps=3, seq_len=64, align_inputs="teacher")]
    eager = run(tiny_config(tmp_path / "e", tiny_teacher_dir, tiny_mask, stages=stages, device="cuda"))
    comp = run(tiny_config(tmp_path / "c", tiny_teacher_dir, tiny_mask, stages=stages, device="cuda", compile=True))
    mse = [[r["loss"] for r in res.history if r.get("stage") == "align" and "loss" in r] for res in (eager, comp)]
    assert len(mse[0]) == 3
    torch.testing.assert_close(torch.tensor(mse[1]), torch.tensor(mse[0]), rtol=2e-3, atol=1e-4)
