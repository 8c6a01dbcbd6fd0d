"""hybrid.train.evals: the evaluation lengths after a run."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybrid.train.evals import eval_lengths
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def llama(max_positions: int):
    """A tiny GQA Llama shaped like SmolLM2 in miniature (3 KV heads of 2 query heads each)."""
    return tiny_model("llama", num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3, hidden_size=48,
                      head_dim=8, max_position_embeddings=max_positions)


def stages(*pairs):
    return SimpleNamespace(stages=[SimpleNamespace(name=n, seq_len=t) for n, t in pairs])


SMOL = stages(("align", 2048), ("distill", 2048), ("long", 8192))


def test_lengths_count_from_the_distill_length_not_the_teachers_positions():
    # SmolLM2: 8192 positions, distilled at 2048 -> NIAH at 2K and 4K/8K/16K, not 16K/32K/64K
    assert eval_lengths(llama(8192), SMOL) == (2048, (4096, 8192, 16384))


def test_lengths_never_pass_the_teachers_training_length_and_the_cap():
    assert eval_lengths(llama(1024), SMOL) == (1024, (2048, 4096, 8192))  # a teacher trained shorter
    assert eval_lengths(llama(8192), SMOL, cap=8192) == (2048, (4096, 8192))
    assert eval_lengths(llama(8192), SMOL, cap=1000) == (2048, (4096,))  # at least one long length
    # the tiny CPU settings (tiny.toml, smollm2_tiny.toml): 128 -> 256 / 512 / 1024
    assert eval_lengths(llama(8192), stages(("align", 128), ("distill", 128), ("long", 512))) == (128, (256, 512, 1024))


def test_reference_teacher_lengths_are_unchanged():
    from headscope.reference import load_model

    teacher, _ = load_model("default", device="cpu")  # trained at 2048 (train_summary.json)
    assert eval_lengths(teacher, SMOL) == (2048, (4096, 8192, 16384))


def test_default_eval_also_takes_the_heldout_loss_at_the_runs_first_length():
    """A stage at 4x the length is also checked at the first stage's length, on the same windows as that stage's
    check (a loss at 8192 tokens is not comparable to one at 2048); a stage at the first length is checked once."""
    from contextlib import nullcontext

    import torch

    from headscope.reference import load_model
    from hybrid.train.evals import EvalContext, default_eval, heldout_loss

    model, tok = load_model("default", device="cpu")
    cache: dict = {}

    def ctx(seq_len):
        return EvalContext(model, tok, seq_len, 2, torch.device("cpu"), nullcontext(), cache=cache, base_len=32)

    short = default_eval(ctx(32))
    assert "eval_heldout_loss_base" not in short and "heldout_base_len" not in short
    long = default_eval(ctx(64))
    assert long["heldout_base_len"] == 32
    assert long["eval_heldout_loss_base"] == short["eval_heldout_loss"] == round(heldout_loss(ctx(32)), 4)
    assert long["eval_heldout_loss"] == round(heldout_loss(ctx(64)), 4) != long["eval_heldout_loss_base"]
