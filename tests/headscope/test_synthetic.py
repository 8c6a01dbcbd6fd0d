"""headscope.synthetic: seeded random Qwen3 models of a shape, and pairs whose answers the corruption moves."""
from __future__ import annotations

import pytest
import torch

from headscope.synthetic import QWEN3_1_7B, moved_answer_pair, random_qwen3

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = dict(layers=2, heads=4, kv_heads=2, head_dim=8, hidden=32, intermediate=64, vocab=97)


def test_random_qwen3_has_the_shape_and_the_seed_fixes_the_weights():
    a = random_qwen3(SMALL, seed=3)
    c = a.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size,
            c.intermediate_size, c.vocab_size) == (2, 4, 2, 8, 32, 64, 97)
    assert c.tie_word_embeddings and c.max_position_embeddings == 40960 and not a.training
    assert random_qwen3(SMALL, seed=3, max_position_embeddings=64).config.max_position_embeddings == 64
    torch.testing.assert_close(a.model.layers[1].mlp.up_proj.weight,
                               random_qwen3(SMALL, seed=3).model.layers[1].mlp.up_proj.weight)
    assert not torch.equal(a.model.layers[1].mlp.up_proj.weight,
                           random_qwen3(SMALL, seed=4).model.layers[1].mlp.up_proj.weight)
    assert set(QWEN3_1_7B) == set(SMALL)


def test_a_shape_without_every_key_is_refused_naming_them():
    with pytest.raises(ValueError, match=r"lacks \['vocab'\]"):
        random_qwen3({k: v for k, v in SMALL.items() if k != "vocab"})


def test_the_pair_differs_in_the_span_and_its_answers_are_the_most_moved_tokens():
    model = random_qwen3(SMALL)
    p = moved_answer_pair(model, seq=24, first_diff=10, answer=3, generator=torch.Generator().manual_seed(0))
    changed = (p.clean_ids != p.corrupt_ids).nonzero().flatten().tolist()
    assert changed == [10, 11, 12, 13] and p.answer_pos.tolist() == [21, 22, 23]
    with torch.no_grad():
        lc = model(p.clean_ids[None]).logits[0, -3:]  # [A, V]
        lx = model(p.corrupt_ids[None]).logits[0, -3:]  # [A, V]
    d = lc - lx  # [A, V]
    rows = torch.arange(3)
    assert torch.equal(d[rows, p.clean_answer_ids], d.max(-1).values)  # the clean answer gains most in the clean run
    assert torch.equal(-d[rows, p.corrupt_answer_ids], (-d).max(-1).values)
    again = moved_answer_pair(model, seq=24, first_diff=10, answer=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.clean_ids, p.clean_ids) and torch.equal(again.clean_answer_ids, p.clean_answer_ids)
    with pytest.raises(ValueError, match="do not fit seq=24"):
        moved_answer_pair(model, seq=24, first_diff=20, answer=3, generator=torch.Generator())
