"""hybrid.train.fused_loss against its naive twin (losses.kl_div / weighted_ce on full logits), and its wiring
into stage 2 (stages.distill_loss, StageConfig.fused_loss)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid.train.fused_loss import fused_distill_loss, naive_distill_loss
from hybrid.train.losses import kl_div, weighted_ce
from testing_utils import assert_close

REPO = Path(__file__).resolve().parents[3]
TOL_OF = {torch.float64: "fp64_exact", torch.float32: "fp32"}


def problem(dtype, B=2, T=7, C=8, Ct=6, V=33, seed=0, zero_w=False):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(B, T, C, generator=g, dtype=dtype).requires_grad_()  # [B, T, C]
    w_s = (torch.randn(V, C, generator=g, dtype=dtype) * 0.5).requires_grad_()  # [V, C]
    h_t = torch.randn(B, T, Ct, generator=g, dtype=dtype)  # [B, T, Ct]
    w_t = torch.randn(V, Ct, generator=g, dtype=dtype) * 0.5  # [V, Ct]
    ids = torch.randint(0, V, (B, T), generator=g)  # [B, T]
    w = torch.rand(B, T, generator=g, dtype=dtype) * 3  # [B, T]
    if zero_w:
        w[0, ::2] = 0.0
        w[1] = 0.0
    return h_s, w_s, h_t, w_t, ids, w


def naive(h_s, w_s, h_t, w_t, ids, w, tau, kl=True, ce=True):
    return naive_distill_loss(h_s, w_s, h_t, w_t, ids, w, temperature=tau, kl=kl, ce=ce)


def grads(terms, coef, h_s, w_s):
    """d/d(h_s, w_s) of sum_i coef_i * sum_i (as the trainer: weight / global count per term)."""
    loss = sum(coef[n] * total for n, (total, _) in terms.items())
    return torch.autograd.grad(loss, (h_s, w_s))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 5, 14, 64])  # N = 14 tokens: 5 does not divide it, 64 > N
@pytest.mark.parametrize("tau,kl,ce,zero_w", [(1.0, True, True, False), (2.5, True, True, True),
                                              (0.7, True, False, False), (1.0, True, False, False),
                                              (1.0, False, True, True), (3.0, False, True, False)])
def test_fused_sums_and_gradients_equal_the_naive_twins(dtype, chunk, tau, kl, ce, zero_w):
    h_s, w_s, h_t, w_t, ids, w = problem(dtype, zero_w=zero_w)
    ref = naive(h_s, w_s, h_t, w_t, ids, w, tau, kl, ce)
    got = fused_distill_loss(h_s, w_s, h_t if kl else None, w_t if kl else None, ids, w, temperature=tau, kl=kl,
                             ce=ce, chunk_tokens=chunk)
    assert list(got) == list(ref)
    tol = TOL_OF[dtype]
    for name in ref:
        assert_close(f"{name} sum", got[name][0], ref[name][0], tol)
        assert torch.equal(got[name][1], ref[name][1]), name  # counts: B*T, sum of w[:, :-1]
        assert got[name][0].dtype == ref[name][0].dtype and got[name][1].dtype == ref[name][1].dtype
    coef = {"kl": 0.37, "ce": 1.9}  # different scales per term: each sum's gradient is scaled on its own
    for a, b, what in zip(grads(got, coef, h_s, w_s), grads(ref, coef, h_s, w_s), ("grad h_s", "grad w_s")):
        assert a.dtype == b.dtype
        assert_close(what, a, b, tol)


def test_each_sum_alone_has_its_own_gradient():
    h_s, w_s, h_t, w_t, ids, w = problem(torch.float64, zero_w=True)
    ref = naive(h_s, w_s, h_t, w_t, ids, w, 2.0)
    got = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, temperature=2.0, chunk_tokens=4)
    for name in ("kl", "ce"):
        a = torch.autograd.grad(got[name][0] * 3.0, (h_s, w_s), retain_graph=True)
        b = torch.autograd.grad(ref[name][0] * 3.0, (h_s, w_s), retain_graph=True)
        for x, y in zip(a, b):
            assert_close(f"{name} alone", x, y, "fp64_exact")


def test_zero_weights_give_zero_ce_and_zero_gradient():
    h_s, w_s, h_t, w_t, ids, w = problem(torch.float64)
    got = fused_distill_loss(h_s, w_s, None, None, ids, torch.zeros_like(w), kl=False, chunk_tokens=3)
    total, count = got["ce"]
    assert float(total.detach()) == 0.0 and float(count) == 0.0
    gh, gw = torch.autograd.grad(total, (h_s, w_s))
    assert not gh.any() and not gw.any()


def test_under_autocast_the_matmuls_run_in_the_autocast_dtype_as_the_naive_path():
    """CPU bf16 autocast stands in for the GPU's: logits in bf16, float32 softmax math, grads in the inputs' dtypes."""
    h_s, w_s, h_t, w_t, ids, w = problem(torch.float32, B=2, T=16, C=32, Ct=24, V=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = naive(h_s, w_s, h_t, w_t, ids, w, 2.0)
        got = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, temperature=2.0, chunk_tokens=7)
    coef = {"kl": 1.0, "ce": 0.2}
    for name in ref:
        assert_close(f"{name} sum", got[name][0], ref[name][0], "bf16_kernel")
    for a, b, what in zip(grads(got, coef, h_s, w_s), grads(ref, coef, h_s, w_s), ("grad h_s", "grad w_s")):
        assert a.dtype == b.dtype == torch.float32
        assert_close(what, a, b, "bf16_kernel")


@pytest.mark.parametrize("tau,kl,ce", [(1.0, True, True), (2.5, True, True), (0.7, True, False), (1.0, False, True)])
def test_the_pure_chunk_math_equals_the_in_place_one(tau, kl, ce):
    """_chunk_terms_pure (what chunk_math="compiled" compiles) gives _chunk_terms' sums and gradients, the gradients
    already in the asked dtype, and leaves its logits unchanged."""
    from hybrid.train.fused_loss import _chunk_terms, _chunk_terms_pure

    g = torch.Generator().manual_seed(1)
    s = torch.randn(9, 40, generator=g, dtype=torch.float64) * 3  # [n, V]
    t = torch.randn(9, 40, generator=g, dtype=torch.float64) * 3  # [n, V]
    tg = torch.randint(0, 40, (9,), generator=g)  # [n]
    wc = torch.rand(9, generator=g, dtype=torch.float64)  # [n]
    s0 = s.clone()
    got = _chunk_terms_pure(s, t, tg, wc, tau, kl, ce, torch.float32)
    assert torch.equal(s, s0)
    ref = _chunk_terms(s.clone(), t.clone(), tg, wc, tau, kl, ce)
    for i in (0, 1):
        assert (got[i] is None) == (ref[i] is None)
        if got[i] is not None:
            assert_close("sum", got[i], ref[i], "fp64_exact")
    assert set(got[2]) == set(ref[2])
    for name in got[2]:
        assert got[2][name].dtype == torch.float32
        assert_close(name, got[2][name], ref[2][name].float(), "fp32")


def test_a_failing_compile_falls_back_to_the_eager_math_with_a_warning(monkeypatch):
    import hybrid.train.fused_loss as fl

    def broken(*args):
        raise RuntimeError("inductor: no compiler here")

    monkeypatch.setattr(fl, "_COMPILED", {"fn": broken})
    h_s, w_s, h_t, w_t, ids, w = problem(torch.float64)
    ref = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, chunk_tokens=4, chunk_math="eager")
    with pytest.warns(UserWarning, match="compiled chunk math failed.*no compiler here.*chunk_math='eager'"):
        got = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, chunk_tokens=4, chunk_math="compiled")
    for name in ref:
        assert torch.equal(got[name][0], ref[name][0])
    assert "failed" in fl._COMPILED and fl._chunk_math("auto", torch.device("cuda")) == "eager"
    with pytest.raises(ValueError, match="chunk_math='fast'"):
        fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, chunk_math="fast")


def test_out_of_memory_in_the_compiled_math_is_raised_not_swallowed(monkeypatch):
    """An out-of-memory error is not a compile failure: it reaches the caller (a sweep's side run reports it) and
    the compiled math stays in use."""
    import hybrid.train.fused_loss as fl

    def oom(*args):
        raise torch.OutOfMemoryError("fake: out of memory")

    monkeypatch.setattr(fl, "_COMPILED", {"fn": oom})
    h_s, w_s, h_t, w_t, ids, w = problem(torch.float64)
    with pytest.raises(torch.OutOfMemoryError):
        fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, chunk_tokens=4, chunk_math="compiled")
    assert "failed" not in fl._COMPILED


@pytest.mark.slow  # inductor on the CPU: a compile of the chunk math
def test_the_compiled_chunk_math_on_the_cpu_equals_the_naive_twin():
    import hybrid.train.fused_loss as fl

    h_s, w_s, h_t, w_t, ids, w = problem(torch.float32, B=2, T=16, C=8, Ct=6, V=50)
    ref = naive(h_s, w_s, h_t, w_t, ids, w, 2.0)
    got = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, temperature=2.0, chunk_tokens=12, chunk_math="compiled")
    assert "failed" not in fl._COMPILED and "fn" in fl._COMPILED
    coef = {"kl": 1.0, "ce": 0.2}
    for name in ref:
        assert_close(f"{name} sum", got[name][0], ref[name][0], "fp32")
    for a, b, what in zip(grads(got, coef, h_s, w_s), grads(ref, coef, h_s, w_s), ("grad h_s", "grad w_s")):
        assert_close(what, a, b, "fp32")


def test_float32_output_matmuls_are_used_only_where_torch_has_them():
    """f32_matmul=None (auto) takes the float32-output matmuls only where torch has them (not on the CPU: the
    half-precision logits are cast as before); True where it has not is refused, naming the fix."""
    from hybrid.train.fused_loss import out_dtype_matmul_available

    assert out_dtype_matmul_available("cpu") is False
    h_s, w_s, h_t, w_t, ids, w = problem(torch.float32, B=1, T=6, C=8, Ct=6, V=40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, chunk_tokens=4)
        off = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, chunk_tokens=4, f32_matmul=False)
        with pytest.raises(RuntimeError, match="f32_matmul=True.*no float32-output matmul.*leave f32_matmul=None"):
            fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, chunk_tokens=4, f32_matmul=True)
    for name in auto:
        assert torch.equal(auto[name][0], off[name][0]), name
    # float32 matmuls have float32 outputs: True asks for nothing and is not refused
    got = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, chunk_tokens=4, f32_matmul=True)
    assert_close("fp32 kl", got["kl"][0], naive(h_s, w_s, h_t, w_t, ids, w, 1.0)["kl"][0], "fp32")


@pytest.mark.gpu
def test_float32_output_matmuls_and_compiled_math_on_cuda_match_the_naive_twin():
    """On the GPU under bf16 autocast (the trainer's setting): the float32-output matmuls (logits without bf16
    rounding, grad_W accumulated by addmm) and the compiled chunk math give the naive twin's sums and gradients
    within bf16 tolerance, as the cast path and the eager math do; SmolLM2's vocabulary, a small batch."""
    from hybrid.train.fused_loss import out_dtype_matmul_available

    assert out_dtype_matmul_available("cuda"), f"torch {torch.__version__}: no out_dtype matmul on CUDA"
    g = torch.Generator().manual_seed(0)
    B, T, C, V = 2, 384, 576, 49152
    h_s = torch.randn(B, T, C, generator=g).cuda().requires_grad_()  # [B, T, C]
    w_s = (torch.randn(V, C, generator=g) * C ** -0.5).cuda().requires_grad_()  # [V, C]
    h_t = torch.randn(B, T, C, generator=g).cuda()  # [B, T, C]
    w_t = (torch.randn(V, C, generator=g) * C ** -0.5).cuda()  # [V, C]
    ids = torch.randint(0, V, (B, T), generator=g).cuda()  # [B, T]
    w = (torch.rand(B, T, generator=g) * 2).cuda()  # [B, T]
    coef = {"kl": 1.0, "ce": 0.2}
    out = {}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out["naive"] = naive(h_s, w_s, h_t, w_t, ids, w, 2.0)
        for mode in (True, False):
            out[mode] = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, temperature=2.0, chunk_tokens=256,
                                           f32_matmul=mode, chunk_math="compiled")
        out["eager"] = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, temperature=2.0, chunk_tokens=256,
                                          chunk_math="eager")
    import hybrid.train.fused_loss as fl

    assert "failed" not in fl._COMPILED, fl._COMPILED.get("failed")
    ref_g = grads(out["naive"], coef, h_s, w_s)
    for mode in (True, False, "eager"):
        for name in out["naive"]:
            assert_close(f"{name} sum f32mm={mode}", out[mode][name][0], out["naive"][name][0], "bf16_kernel")
        for a, b, what in zip(grads(out[mode], coef, h_s, w_s), ref_g, ("grad h_s", "grad w_s")):
            assert a.dtype == b.dtype == torch.float32
            assert_close(f"{what} f32mm={mode}", a, b, "bf16_kernel")


def test_bad_calls_are_refused():
    h_s, w_s, h_t, w_t, ids, w = problem(torch.float32)
    with pytest.raises(ValueError, match="bias"):
        fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, bias=torch.zeros(w_s.shape[0]))
    with pytest.raises(ValueError, match="needs the teacher"):
        fused_distill_loss(h_s, w_s, None, None, ids, w)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, chunk_tokens=0)
    with pytest.raises(ValueError, match="at least one term"):
        fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, kl=False, ce=False)
    with pytest.raises(ValueError, match="shapes"):
        fused_distill_loss(h_s, w_s.T, h_t, w_t, ids, w)


# ---- models: the final hidden state, and a distill step fused vs naive ------------------------------------------
def tiny_hybrid(teacher):
    from headscope.heads import Head
    from headscope.mask import HeadMask
    from hybrid.convert import from_mask

    return from_mask(teacher, HeadMask.for_model(teacher.config, [Head(0, 1), Head(1, 2)]), check_fingerprint=False)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_hidden_states_last_is_the_lm_heads_input_for_hf_and_the_hybrid(family):
    """transformers 5 ties hidden_states[-1] to the post-norm last_hidden_state; HybridModel returns the normed
    state last: lm_head(hidden_states[-1]) are the full logits, with one logit row computed."""
    from model_factories import tiny_model

    from hybrid.train.stages import final_hidden

    teacher = tiny_model(family)
    ids = torch.randint(0, 128, (2, 9))  # [B, T]
    for m in (teacher, tiny_hybrid(teacher)):
        full = m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits  # [B, T, V]
        h, weight = final_hidden(m, ids)  # [B, T, C], [V, C]
        assert weight is m.lm_head.weight
        assert_close(f"{type(m).__name__} logits", h @ weight.T, full, "fp32")


def test_a_model_whose_hidden_state_is_not_the_heads_input_is_refused():
    from model_factories import tiny_model

    from hybrid.train.stages import final_hidden

    m = tiny_model("qwen3", seed=1)
    m.lm_head.register_forward_hook(lambda mod, args, out: out * 2.0)  # a logit scale the fused loss would miss
    with pytest.raises(RuntimeError, match="fused_loss='off'"):  # FusedLossMismatch
        final_hidden(m, torch.randint(0, 128, (2, 9)))


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_failed_head_check_falls_back_under_auto_and_stops_under_on(mode, monkeypatch):
    """A model whose final hidden state is not the lm_head's input: "on" stops with the error; "auto" warns once,
    computes this step's loss on the naive path and stays there (a GPU run is not lost to another transformers)."""
    from contextlib import nullcontext

    from model_factories import tiny_model

    from hybrid.train import StageConfig
    from hybrid.train import stages
    from hybrid.train.stages import FusedLossMismatch, distill_loss

    from train_factories import stage

    monkeypatch.setattr(stages, "AUTO_DEVICES", ("cpu", "cuda"))  # "auto" fuses here as on a GPU
    teacher, student = tiny_model("qwen3", seed=1), tiny_model("qwen3", seed=2)
    student.lm_head.register_forward_hook(lambda mod, args, out: out * 2.0)
    cfg = StageConfig(**stage("distill", fused_loss=mode))
    ids, w = torch.randint(0, 128, (2, 9)), torch.ones(2, 9)  # [B, T]
    if mode == "on":
        with pytest.raises(FusedLossMismatch, match="fused_loss='off'"):
            distill_loss(cfg, student, teacher, ids, w, nullcontext())
        return
    with pytest.warns(UserWarning, match="continues with the naive loss"):
        terms = distill_loss(cfg, student, teacher, ids, w, nullcontext())
    s, t = student(input_ids=ids).logits, teacher(input_ids=ids).logits  # [B, T, V]
    assert_close("kl", terms[0][2], kl_div(s, t)[0], "fp32")
    assert_close("ce", terms[1][2], weighted_ce(s, ids, w)[0], "fp32")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second step: naive at once, no second warning
        distill_loss(cfg, student, teacher, ids, w, nullcontext())


def distill_step(cfg, student, teacher, ids, w):
    """The trainer's loss on these terms (world 1) and d loss / d parameters."""
    from contextlib import nullcontext

    from hybrid.train.stages import distill_loss

    terms = distill_loss(cfg, student, teacher, ids, w, nullcontext())
    counts = torch.stack([c.detach().float() for *_, c in terms])  # [n_terms]
    loss = sum(wt * total / counts[j].clamp_min(1e-12) for j, (_, wt, total, _) in enumerate(terms))
    params = [p for p in student.parameters() if p.requires_grad]
    return [(name, wt, total.detach()) for name, wt, total, _ in terms], loss, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("kl_weight,ce_weight,temperature", [(1.0, 0.2, 1.0), (0.5, 0.0, 2.0), (0.0, 1.0, 1.0)])
def test_a_tiny_distill_step_fused_equals_naive(tiny_teacher_dir, kl_weight, ce_weight, temperature):
    from hybrid.train import StageConfig
    from hybrid.train.build import load_teacher
    from hybrid.train.stages import use_fused_loss
    from train_factories import stage

    teacher, _ = load_teacher(str(tiny_teacher_dir), torch.device("cpu"))
    student = tiny_hybrid(teacher).train()
    assert student.lm_head.weight is student.model.embed_tokens.weight  # tied: both gradients reach it
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, teacher.config.vocab_size, (2, 24), generator=g)  # [B, T]
    w = torch.rand(2, 24, generator=g) * 2  # [B, T]
    res = {}
    for mode in ("off", "on"):
        cfg = StageConfig(**stage("distill", kl_weight=kl_weight, ce_weight=ce_weight, temperature=temperature,
                                  fused_loss=mode))
        assert use_fused_loss(cfg, student, teacher, ids) == (mode == "on")
        res[mode] = distill_step(cfg, student, teacher, ids, w)
    (n_sums, n_loss, n_grads), (f_sums, f_loss, f_grads) = res["off"], res["on"]
    assert [x[:2] for x in f_sums] == [x[:2] for x in n_sums]  # names and weights
    for (name, _, a), (_, _, b) in zip(f_sums, n_sums):
        assert_close(f"{name} sum", a, b, "fp32")
    assert_close("loss", f_loss, n_loss, "fp32")
    for (name, _), a, b in zip([(n, p) for n, p in student.named_parameters() if p.requires_grad], f_grads, n_grads):
        assert_close(name, a, b, "fp32")
    auto = StageConfig(**stage("distill"))
    assert auto.fused_loss == "auto" and not use_fused_loss(auto, student, teacher, ids)  # CPU: the naive path


def test_fused_on_is_refused_where_it_cannot_run(tiny_teacher_dir):
    from hybrid.train import StageConfig
    from hybrid.train.build import load_teacher
    from hybrid.train.stages import use_fused_loss
    from train_factories import stage

    teacher, _ = load_teacher(str(tiny_teacher_dir), torch.device("cpu"))
    student = tiny_hybrid(teacher)
    student.lm_head = torch.nn.Linear(student.config.hidden_size, student.config.vocab_size, bias=True)
    ids = torch.zeros(1, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=r"stages\[distill\]\.fused_loss='on': .*bias"):
        use_fused_loss(StageConfig(**stage("distill", fused_loss="on")), student, teacher, ids)
    assert not use_fused_loss(StageConfig(**stage("distill", fused_loss="auto")), student, teacher, ids)


# ---- config -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("patch,match", [
    ({"stages": [{"name": "distill", "steps": 1, "lr": 1e-3, "fused_loss": "yes"}]},
     r"stages\[distill\]\.fused_loss='yes': must be one of \('auto', 'on', 'off'\)"),
    ({"stages": [{"name": "align", "steps": 1, "lr": 1e-3, "fused_loss": "on"}]},
     r"stages\[align\]\.fused_loss='on': the fused loss is a 'distill' option"),
    ({"distributed": "fsdp", "stages": [{"name": "distill", "steps": 1, "lr": 1e-3, "fused_loss": "on"}]},
     r"stages\[distill\]\.fused_loss='on': FSDP shards the lm_head weight"),
])
def test_bad_fused_loss_configs_are_refused(patch, match):
    from hybrid.train import TrainConfig, TrainConfigError

    with pytest.raises(TrainConfigError, match=match):
        TrainConfig.from_dict({"out": "/tmp/x", "mask": "m.json", **patch})


def test_fused_loss_leaves_the_fingerprint_alone():
    from hybrid.train import TrainConfig

    d = {"out": "/tmp/x", "mask": "m.json", "stages": [{"name": "distill", "steps": 1, "lr": 1e-3}]}
    cfg = TrainConfig.from_dict(d)
    off = TrainConfig.from_dict({**d, "stages": [{**d["stages"][0], "fused_loss": "off"}]})
    assert off.stages[0].fused_loss == "off" and off.fingerprint() == cfg.fingerprint()
    assert TrainConfig.from_dict(off.to_dict()) == off


@pytest.mark.slow  # ~30 s on 2 shared cores (two processes plus one)
def test_ddp_with_the_fused_loss_matches_one_naive_process(tmp_path, tiny_teacher_dir, tiny_mask):
    """2 gloo processes (DDP: the wrapper's forward runs, its gradient hooks fire for the tied lm_head) with
    fused_loss="on" vs one process with the naive loss, same global batch: the same losses at every step."""
    from hybrid.train.cli import main
    from hybrid.train.logs import read_log

    from train_factories import stage, tiny_config

    def config(name: str, fused: str, **kw) -> Path:  # a JSON config file (TrainConfig.from_file reads it)
        cfg = tiny_config(tmp_path / name, tiny_teacher_dir, tiny_mask, **kw,
                          stages=[stage("distill", steps=3, seq_len=32, batch_size=4, temperature=2.0,
                                        fused_loss=fused)])
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(cfg.to_dict()))
        return p

    assert main(["--config", str(config("one", "off"))]) == 0
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "hybrid.train.cli", "--config", str(config("two", "on", distributed="ddp"))],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = [r for r in read_log(tmp_path / "one" / "log.jsonl") if "loss" in r]
    b = [r for r in read_log(tmp_path / "two" / "log.jsonl") if "loss" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for k in ("loss", "loss_kl", "loss_ce"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), (k, ra, rb)
    # the tied embedding / lm_head weight's update over the 3 steps: the same (its gradient reached DDP's reducer)
    from safetensors.torch import load_file

    key = "model.embed_tokens.weight"
    start = load_file(tiny_teacher_dir / "model.safetensors")[key].double()  # [V, C]
    one, two = (load_file(tmp_path / n / "hybrid" / "model.safetensors")[key].double() for n in ("one", "two"))
    assert float((one - start).norm()) > 0
    assert_close("embedding update", two - start, one - start, 1e-4)
