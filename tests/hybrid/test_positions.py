"""The hybrid runs past its config's max_position_embeddings (the teacher's, kept as a record): nothing in the
forward reads it, RoPE on the GDN (and, with fa_rope, the FA) heads is computed for any position, and the NoPE FA
heads' log-length scale grows with the position. A tiny hybrid whose config says 64 positions runs 200 tokens: the
same logits whatever that number says, and a cached prefill + decode across position 64 gives the full forward's
logits."""
import pytest
import torch

from headscope.mask import HeadMask
from hybrid.convert import from_mask
from hybrid.layers.common import RotaryEmbedding

from model_factories import tiny_model
from testing_utils import assert_close

FA = [(0, 1), (1, 0), (1, 3), (2, 2)]
T = 200  # > 64 = the teacher's (and so the hybrid's) max_position_embeddings


def hybrid(max_positions: int, **options):
    teacher = tiny_model("qwen3", max_position_embeddings=max_positions)
    return from_mask(teacher, HeadMask.for_model(teacher, FA), **options).eval()


@pytest.mark.parametrize("options", [{}, {"fa_rope": True, "fa_log_scale": False}])
def test_a_hybrid_runs_past_its_configured_positions(options):
    short, long = hybrid(64, **options), hybrid(4096, **options)
    assert short.config.max_position_embeddings == 64
    ids = torch.randint(3, 128, (2, T))
    with torch.no_grad():
        full = short(ids, use_cache=False).logits  # [2, T, V]
        assert torch.isfinite(full).all()
        torch.testing.assert_close(full, long(ids, use_cache=False).logits, rtol=0, atol=0)  # the number is unused
        out = short(ids[:, :50])  # a cache filled to position 50, then one token at a time past position 64
        steps = [out.logits[:, -1]]
        cache = out.hybrid_cache
        for t in range(50, T - 1):
            out = short(ids[:, t:t + 1], hybrid_cache=cache)
            cache = out.hybrid_cache
            steps.append(out.logits[:, -1])
    assert cache.seen_tokens == T - 1
    assert_close("decoded past the positions", torch.stack(steps, 1), full[:, 49:T - 1], "fp32")


def test_rope_tables_extend_past_the_positions():
    model = hybrid(64)
    rope = model.model.rotary_emb
    assert isinstance(rope, RotaryEmbedding)
    pos = torch.arange(0, 40_000, 997)  # [P] far past 64
    cos, sin = rope(pos, torch.float32)  # [P, D]
    inv = 1.0 / (model.config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))  # [D/2]
    angles = pos.float()[:, None] * inv[None]  # [P, D/2]
    torch.testing.assert_close(cos, torch.cat([angles.cos()] * 2, -1))
    torch.testing.assert_close(sin, torch.cat([angles.sin()] * 2, -1))


def test_generate_runs_past_the_positions():
    model = hybrid(64)
    ids = torch.randint(3, 128, (1, 60))
    out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    seq = ids
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert out.shape == (1, 72) and torch.equal(out, seq)
