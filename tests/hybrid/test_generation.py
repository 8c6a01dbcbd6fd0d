"""generate() on a hybrid: greedy, sampling and beam search give the teacher's tokens for a hybrid equal to its
teacher (hybrid.from_teacher), beam search with GDN and conv states equals beam search without a cache, and the
cache follows the beams (HybridCache.align)."""
import pytest
import torch

from headscope.mask import HeadMask
from hybrid.builders import from_teacher
from hybrid.cache import CacheMismatchError, HybridCache
from hybrid.convert import from_mask

from model_factories import tiny_model

FA = [(0, 1), (1, 0), (1, 3), (2, 2)]
KW = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0)
MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=0, temperature=1.0),
    "beam3": dict(do_sample=False, num_beams=3),
    "beam3_return3": dict(do_sample=False, num_beams=3, num_return_sequences=3),
    "beam_sample": dict(do_sample=True, num_beams=3, top_k=0),
}


def _generate(model, seed=1, **kw):
    torch.manual_seed(seed)
    return model.generate(**KW, **kw)


@pytest.fixture(scope="module")
def pair():
    teacher = tiny_model("qwen3", dtype=torch.float64)
    return teacher, from_teacher(teacher)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_from_teacher_generates_the_teachers_tokens(pair, mode):
    teacher, model = pair
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    expected = _generate(teacher, inputs=ids, **MODES[mode])
    assert torch.equal(_generate(model, inputs=ids, **MODES[mode]), expected)


def test_beam_search_from_inputs_embeds_matches_the_teacher(pair):
    teacher, model = pair
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    emb = teacher.model.embed_tokens(ids).detach()  # [B, T, C]
    for mode in ("greedy", "beam3"):
        expected = _generate(teacher, inputs_embeds=emb, **MODES[mode])
        assert torch.equal(_generate(model, inputs_embeds=emb, **MODES[mode]), expected), mode


def test_the_beam_test_detects_an_unaligned_cache(pair, monkeypatch):
    """Without the alignment (today's bug: the cache never follows the beams) beam search differs from the
    teacher on these prompts, so the test above would catch a regression."""
    teacher, model = pair
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    expected = _generate(teacher, inputs=ids, **MODES["beam3"])
    monkeypatch.setattr(HybridCache, "align", lambda self, input_ids: None)
    assert not torch.equal(_generate(model, inputs=ids, **MODES["beam3"]), expected)


@pytest.mark.parametrize("kw", [{}, {"gdn_conv": True, "merge": "gated_head"}])
def test_beam_search_on_a_real_hybrid_equals_beam_search_without_cache(kw):
    """FA keys/values, GDN states and conv states are reordered together: with the cache the beams are those
    of recomputing every sequence from scratch (use_cache=False)."""
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = from_mask(teacher, HeadMask.for_model(teacher, FA), **kw)
    with torch.no_grad():
        for p in model.new_parameters().values():  # off init, so gates, convs and decays matter
            p.add_(torch.randn_like(p) * 0.3)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    for mode in ("beam3", "beam_sample"):
        cached = _generate(model, inputs=ids, **MODES[mode])
        fresh = _generate(model, inputs=ids, use_cache=False, **MODES[mode])
        assert torch.equal(cached, fresh), mode


def test_align_reorders_every_state_and_refuses_foreign_rows():
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = from_mask(teacher, HeadMask.for_model(teacher, FA), gdn_conv=True)
    ids = torch.randint(3, 128, (3, 5))
    with torch.no_grad():
        cache = model(ids).hybrid_cache
        ref = [(l.keys, l.state, l.conv[0]) for l in cache.layers]
        order = torch.tensor([2, 0, 2])
        cache.align(ids[order])  # rows 2, 0, 2 of the cache
    for (k, s, c), layer in zip(ref, cache.layers):
        for old, new in ((k, layer.keys), (s, layer.state), (c, layer.conv[0])):
            if old is not None:
                assert torch.equal(new, old[order])
    assert torch.equal(cache.history, ids[order])
    with pytest.raises(CacheMismatchError, match="do not continue any row"):
        cache.align(torch.ones(3, 6, dtype=torch.long))  # ids 1: never in a cached row (those are >= 3)
    with pytest.raises(CacheMismatchError, match="already consumed"):
        cache.align(ids[:, :2])


def test_align_refuses_beams_it_cannot_tell_apart():
    """Rows with the same generated ids but different inputs_embeds prompts: which cached row is which beam's
    cannot be known, so it is refused with the fix (use input_ids)."""
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = from_teacher(teacher)
    emb = torch.randn(2, 4, 64, dtype=torch.float64)
    with torch.no_grad():
        cache = model(inputs_embeds=emb).hybrid_cache
        model(torch.tensor([[5], [5]]), hybrid_cache=cache)
    with pytest.raises(CacheMismatchError, match="use input_ids for beam search"):
        cache.align(torch.tensor([[5, 7], [5, 7], [5, 7]]))
