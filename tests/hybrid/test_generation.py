"""generate() on a hybrid: greedy, sampling and beam search give the teacher's tokens for a hybrid equal to its
teacher (hybrid.from_teacher), beam search with GDN and conv states equals beam search without a cache, and the
cache follows the beams (HybridCache.align).

The fast path (hybrid.generation, float64 on the CPU): greedy tokens equal the eager path's (static_cache=False)
for the head-level hybrid, the teacher as a hybrid and the token-level baseline, on ragged left- and right-padded
batches (each row equal to generating it alone); sampling draws the eager path's tokens with the same seed (both
take torch.multinomial over the same processed probabilities, in the same order); the logits processors, EOS ids,
stop strings, min/max lengths, the streamer, output_scores and num_return_sequences behave as on the eager path;
what it does not run falls back with a logged reason; the kept cache is reused and dropped when a weight changes."""
import logging

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import hybrid.generation as generation
from headscope.mask import HeadMask
from hybrid.builders import from_teacher, from_token_level
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


# ---- the fast path (hybrid.generation) ------------------------------------------------------------------------
HEAD_FA = [(0, 1), (0, 2), (1, 0), (1, 3), (2, 2)]
BUILDERS = {
    "head": lambda t: from_mask(t, HeadMask.for_model(t, HEAD_FA), gdn_conv=True, merge="gated_head"),
    "teacher": lambda t: from_teacher(t),
    "token": lambda t: from_token_level(t, window=4),
}
PAD = 0
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=PAD)


def _perturbed(model):
    with torch.no_grad():
        for p in model.new_parameters().values():  # off init, so gates, convs and decays matter
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def models():
    teacher = tiny_model("qwen3", dtype=torch.float64)
    torch.manual_seed(5)
    return {name: _perturbed(build(teacher)) for name, build in BUILDERS.items()} | {"hf": teacher}


def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g) for n in lengths]


def _padded(rows, side="left"):
    """rows -> (ids [B, T] padded with PAD on ``side``, attention_mask [B, T])."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        sl = slice(T - len(r), T) if side == "left" else slice(0, len(r))
        ids[b, sl], mask[b, sl] = r, 1
    return ids, mask


def _seeded(model, seed=1, **kw):
    torch.manual_seed(seed)
    return model.generate(**kw)


def _per_row(model, rows, **kw):
    """Each row generated alone on the eager path: the new tokens, a list of [n] tensors."""
    return [model.generate(r[None], static_cache=False, **kw)[0, len(r):] for r in rows]


@pytest.fixture
def fast_calls(monkeypatch):
    """How many generate() calls took the fast path (hybrid.generation._fast_sample)."""
    calls = []
    real = generation._fast_sample

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(generation, "_fast_sample", spy)
    return calls


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fast_greedy_on_a_ragged_batch_equals_each_row_alone(models, name, side, fast_calls):
    model = models[name]
    rows = _rows((7, 4, 9, 4))
    ids, mask = _padded(rows, side)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)  # [B, T + 6]
    assert fast_calls == [1]
    assert torch.equal(out[:, :ids.shape[1]], ids)  # the input as given, padding included
    for b, ref in enumerate(_per_row(model, rows, max_new_tokens=6, **GREEDY)):
        assert out[b, ids.shape[1]:].tolist() == ref.tolist(), (name, side, b)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fast_greedy_equals_eager_on_an_unpadded_batch(models, name, fast_calls):
    model = models[name]
    ids = torch.stack(_rows((6, 6, 6), seed=1))  # [3, 6]
    fast = model.generate(ids, max_new_tokens=7, **GREEDY)
    assert torch.equal(fast, model.generate(ids, max_new_tokens=7, static_cache=False, **GREEDY))
    assert fast_calls == [1]


@pytest.fixture
def keeps_all_ones_mask(monkeypatch):
    """transformers as some 5.x versions (e.g. 5.17) run it: the all-ones attention_mask that generate() makes
    for a call without one reaches ``_sample`` (later versions drop it first)."""
    import transformers.generation.utils as tgu

    real = tgu.GenerationMixin._sample
    seen = []

    def sample(self, *a, **k):
        seen.append(k.get("attention_mask"))
        return real(self, *a, **k)

    def hybrid_sample(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                      streamer=None, **model_kwargs):
        if model_kwargs.get("attention_mask") is None:
            model_kwargs["attention_mask"] = torch.ones_like(input_ids)  # [B, T], as generate() made it
        seen.append(model_kwargs["attention_mask"])
        return real_hybrid(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                           streamer, **model_kwargs)

    real_hybrid = generation.sample
    monkeypatch.setattr(generation, "sample", hybrid_sample)
    monkeypatch.setattr(tgu.GenerationMixin, "_sample", sample)
    return seen


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_generates_own_all_ones_mask_keeps_the_fast_path(models, name, fast_calls, keeps_all_ones_mask):
    """A call without a mask stays on the fast path when transformers hands ``_sample`` its own all-ones mask
    (on transformers 5.17 every such call had gone to the eager loop, ~30x slower per step on an H200)."""
    model = models[name]
    ids = torch.stack(_rows((6, 6), seed=3))  # [2, 6]
    fast = model.generate(ids, max_new_tokens=5, **GREEDY)
    assert fast_calls == [1] and keeps_all_ones_mask and keeps_all_ones_mask[0] is not None
    assert torch.equal(fast, model.generate(ids, max_new_tokens=5, static_cache=False, **GREEDY))
    padded, _ = _padded(_rows((5, 3), seed=12))  # pad ids without a mask are still refused, as without one
    with pytest.raises(ValueError, match="look padded|padding"):
        model.generate(padded, max_new_tokens=2, do_sample=False, pad_token_id=PAD, eos_token_id=None)


SAMPLING = {
    "plain": dict(do_sample=True, top_k=0),
    "warpers": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
    "min_p": dict(do_sample=True, min_p=0.05, temperature=1.3),
    "repetition": dict(do_sample=True, top_k=0, repetition_penalty=1.4, no_repeat_ngram_size=2),
}


@pytest.mark.parametrize("mode", sorted(SAMPLING))
def test_fast_sampling_draws_the_eager_paths_tokens_with_the_same_seed(models, mode, fast_calls):
    """Both paths softmax the same float32 processed scores and call torch.multinomial once per step over the
    batch: the same seed gives the same tokens (and the fast path is reproducible)."""
    model = models["head"]
    ids = torch.stack(_rows((5, 5), seed=2))
    kw = dict(max_new_tokens=8, eos_token_id=None, pad_token_id=PAD, **SAMPLING[mode])
    got = [_seeded(model, inputs=ids, seed=s, **kw) for s in (3, 3, 4)]
    assert torch.equal(got[0], got[1]) and not torch.equal(got[0], got[2])
    assert torch.equal(got[0], _seeded(model, inputs=ids, seed=3, static_cache=False, **kw))
    assert len(fast_calls) == 3


def test_fast_sampling_on_a_padded_batch_equals_the_hf_teacher(models):
    """The teacher as a hybrid on the fast path and the Hugging Face teacher on the same left-padded batch with
    its mask: the same processors see the same ids (the repetition penalty skips the padding in both). The HF
    model runs with SDPA (its eager attention in float64 turns left-padded rows into NaN)."""
    hf = tiny_model("qwen3", dtype=torch.float64, attn_implementation="sdpa")  # the fixture's teacher's weights
    assert all(torch.equal(a, b) for a, b in zip(hf.parameters(), models["hf"].parameters()))
    ids, mask = _padded(_rows((6, 3, 8), seed=3))
    for kw in (dict(do_sample=True, top_k=0), dict(do_sample=True, top_p=0.8, repetition_penalty=1.3),
               dict(do_sample=False, repetition_penalty=1.5)):
        kw = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=PAD, **kw)
        ref = _seeded(hf, inputs=ids, attention_mask=mask, **kw)
        assert torch.equal(_seeded(models["teacher"], inputs=ids, attention_mask=mask, **kw), ref), kw


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2), dict(do_sample=True, top_k=1),
    dict(do_sample=True, top_p=1e-6, temperature=0.5), dict(min_new_tokens=4, eos_token_id=[5, 9]),
    dict(sequence_bias={(7,): -5.0}, suppress_tokens=[1, 2]),
], ids=["repetition", "ngram", "top_k1", "tiny_top_p", "min_new_eos", "bias_suppress"])
def test_processors_on_a_ragged_batch_equal_each_row_alone(models, kw):
    """Greedy or greedy-equivalent settings: every row of a ragged batch gets what it gets alone on the eager
    path (the repetition penalty ignores a row's left padding, as in transformers)."""
    model = models["head"]
    rows = _rows((8, 3, 6), seed=4)
    ids, mask = _padded(rows)
    kw = dict(GREEDY, max_new_tokens=6) | kw
    out = model.generate(ids, attention_mask=mask, **kw)
    for b, ref in enumerate(_per_row(model, rows, **kw)):
        n = len(ref)
        assert out[b, ids.shape[1]:ids.shape[1] + n].tolist() == ref.tolist(), (kw, b)
        assert (out[b, ids.shape[1] + n:] == PAD).all()  # finished early: the pad token after it


def _first_greedy(model, rows, n=6):
    ids, mask = _padded(rows)
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, **GREEDY)[:, ids.shape[1]:]


@pytest.mark.parametrize("every", [1, 3])
def test_eos_ends_a_row_pads_it_and_stops_when_all_rows_ended(models, every, monkeypatch):
    """Rows that meet an EOS id continue with the pad token; the call ends at the step where the last row
    ends. every=3: the host reads the flag every 3 steps (as on CUDA) and the surplus steps are dropped."""
    monkeypatch.setattr(generation, "_check_every", lambda device, streamer: every)
    model = models["head"]
    rows = _rows((5, 7, 4), seed=6)
    free = _first_greedy(model, rows, 8)  # [3, 8] no EOS
    eos = [int(free[0, 1]), int(free[2, 3])]  # row 0 ends at its 2nd token, row 2 at its 4th (or earlier)
    ids, mask = _padded(rows)
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    out = model.generate(ids, attention_mask=mask, **kw)
    per_row = _per_row(model, rows, **kw)
    assert out.shape[1] == ids.shape[1] + max(len(r) for r in per_row)
    for b, ref in enumerate(per_row):
        new = out[b, ids.shape[1]:]
        assert new[:len(ref)].tolist() == ref.tolist() and (new[len(ref):] == PAD).all(), b
    assert len(per_row[0]) == 2
    rows1 = [rows[0]]  # every row ends early: the output stops there too
    one = model.generate(_padded(rows1)[0], max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    assert one.shape[1] == len(rows1[0]) + 2


def test_scores_logits_max_length_and_return_sequences_equal_eager(models):
    model = models["head"]
    ids = torch.stack(_rows((5, 5), seed=7))
    kw = dict(max_length=ids.shape[1] + 5, eos_token_id=None, pad_token_id=PAD, return_dict_in_generate=True,
              output_scores=True, output_logits=True)
    fast = model.generate(ids, do_sample=False, **kw)
    eager = model.generate(ids, do_sample=False, static_cache=False, **kw)
    assert torch.equal(fast.sequences, eager.sequences) and fast.sequences.shape[1] == ids.shape[1] + 5
    for a, b in zip(fast.scores + fast.logits, eager.scores + eager.logits):
        assert a.dtype == b.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert len(fast.scores) == len(eager.scores) == 5
    kw = dict(max_new_tokens=5, eos_token_id=None, pad_token_id=PAD, do_sample=True, num_return_sequences=3)
    fast = _seeded(model, inputs=ids, seed=8, **kw)
    assert fast.shape == (6, ids.shape[1] + 5)
    assert torch.equal(fast, _seeded(model, inputs=ids, seed=8, static_cache=False, **kw))


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


def test_the_streamer_gets_the_prompt_then_each_token(models):
    model = models["head"]
    row = _rows((6,), seed=9)[0][None]  # [1, 6]
    got, ref = Recorder(), Recorder()
    out = model.generate(row, max_new_tokens=5, streamer=got, **GREEDY)
    model.generate(row, max_new_tokens=5, streamer=ref, static_cache=False, **GREEDY)
    assert got.ended == ref.ended == 1 and len(got.puts) == len(ref.puts) == 6
    assert all(torch.equal(a, b) for a, b in zip(got.puts, ref.puts))
    assert torch.equal(torch.cat([p.reshape(1, -1) for p in got.puts], 1), out)
    ids, mask = _padded(_rows((6, 3), seed=9), side="right")  # right padding: the prompt as given
    rec = Recorder()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, streamer=rec, **GREEDY)
    assert torch.equal(rec.puts[0], ids) and torch.equal(torch.stack(rec.puts[1:], 1), out[:, ids.shape[1]:])


def test_stop_strings_with_the_tokenizer(ref_tokenizer):
    tok = ref_tokenizer
    teacher = tiny_model("qwen3", vocab_size=len(tok), dtype=torch.float64)
    model = _perturbed(from_mask(teacher, HeadMask.for_model(teacher, HEAD_FA)))
    ids = tok(["Once upon a time", "The pass key is 4172."], return_tensors="pt", padding=True,
              padding_side="left")
    free = model.generate(**ids, max_new_tokens=8, **GREEDY)[:, ids.input_ids.shape[1]:]
    stop = tok.decode(free[0, 2:3])  # row 0's third token's text
    assert stop.strip(), "pick a row whose third token has text"
    kw = dict(max_new_tokens=8, stop_strings=[stop], tokenizer=tok, **GREEDY)
    out = model.generate(**ids, **kw)[:, ids.input_ids.shape[1]:]
    rows = [r[m.bool()] for r, m in zip(ids.input_ids, ids.attention_mask)]
    for b, ref in enumerate(_per_row(model, rows, **kw)):
        assert out[b, :len(ref)].tolist() == ref.tolist()
    assert stop in tok.decode(out[0, :3]) and out.shape[1] <= 8


@pytest.mark.parametrize("case", ["beam", "embeds", "no_cache", "hidden_states"])
def test_what_the_fast_path_does_not_run_falls_back_with_the_reason(models, case, caplog, fast_calls):
    model = models["head"]
    ids = torch.stack(_rows((5, 5), seed=10))
    kw = dict(max_new_tokens=4, eos_token_id=None, pad_token_id=PAD)
    args = {"beam": dict(inputs=ids, num_beams=3),
            "embeds": dict(inputs_embeds=model.model.embed_tokens(ids).detach()),
            "no_cache": dict(inputs=ids, use_cache=False),
            "hidden_states": dict(inputs=ids, output_hidden_states=True, return_dict_in_generate=True)}[case]
    why = {"beam": "beam search", "embeds": "inputs_embeds", "no_cache": "use_cache=False",
           "hidden_states": "output_hidden_states"}[case]
    with caplog.at_level(logging.INFO, logger="hybrid.generation"):
        out = model.generate(**args, **kw)
    notes = [r.getMessage() for r in caplog.records if r.name == "hybrid.generation"]
    assert len(notes) == 1 and why in notes[0] and fast_calls == []
    with caplog.at_level(logging.INFO, logger="hybrid.generation"):
        again = model.generate(**args, static_cache=False, **kw)  # opting out is not logged
    assert len([r for r in caplog.records if r.name == "hybrid.generation"]) == 1
    seqs = lambda o: o if isinstance(o, torch.Tensor) else o.sequences  # noqa: E731
    assert torch.equal(seqs(out), seqs(again))


def test_opting_out_and_the_generation_config_switch(models, fast_calls):
    model = models["head"]
    ids = torch.stack(_rows((5,), seed=11))
    model.generate(ids, max_new_tokens=3, static_cache=False, **GREEDY)
    assert fast_calls == []
    model.generation_config.static_cache = False
    try:
        model.generate(ids, max_new_tokens=3, **GREEDY)
        assert fast_calls == []
        model.generate(ids, max_new_tokens=3, static_cache=True, **GREEDY)  # the keyword wins
        assert fast_calls == [1]
    finally:
        del model.generation_config.static_cache
    with pytest.raises(ValueError, match="static_cache must be"):
        model.generate(ids, max_new_tokens=3, static_cache="yes", **GREEDY)


def test_padding_is_only_stripped_where_a_mask_says_so(models):
    """No attention_mask: rows that look padded are refused as on the eager path (transformers infers a mask
    from the pad ids when pad != eos; the hybrid does not guess). A mask with a hole, or a row of padding only,
    goes to the eager path, which refuses padding."""
    model = models["head"]
    ids, mask = _padded(_rows((5, 3), seed=12))
    for kw in (dict(eos_token_id=None), dict(eos_token_id=1)):
        with pytest.raises(ValueError, match="look padded|padding"):
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=PAD, **kw)
    holey = mask.clone()
    holey[0, 3] = 0
    empty = mask.clone()
    empty[1] = 0
    for m in (holey, empty):
        with pytest.raises(ValueError, match="padding"):
            model.generate(ids, attention_mask=m, max_new_tokens=2, **GREEDY)


def test_the_kept_cache_is_reused_and_dropped_when_a_weight_changes(models):
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = _perturbed(BUILDERS["head"](teacher))
    rows = _rows((6, 4), seed=13)
    ids, mask = _padded(rows)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
    kept = generation._KEPT[model]
    ids2, mask2 = _padded(_rows((5, 6), seed=14))  # same batch, capacity bucket: the same buffers
    second = model.generate(ids2, attention_mask=mask2, max_new_tokens=5, **GREEDY)
    assert generation._KEPT[model] is kept and not kept.busy
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY), first)
    rows2 = [r[m.bool()] for r, m in zip(ids2, mask2)]
    for b, ref in enumerate(_per_row(model, rows2, max_new_tokens=5, **GREEDY)):
        assert second[b, ids2.shape[1]:].tolist() == ref.tolist()
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # in place: a new version, so a new cache (and graph on CUDA)
    flipped = model.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
    assert generation._KEPT[model] is not kept
    for b, ref in enumerate(_per_row(model, rows, max_new_tokens=5, **GREEDY)):
        assert flipped[b, ids.shape[1]:].tolist() == ref.tolist()
    generation.release(model)
    assert model not in generation._KEPT


def test_switching_the_gdn_decode_op_makes_a_new_decode_step(models):
    """use_fused_decode between two calls: the kept step (a CUDA graph on CUDA) was made with the split op, so the
    next call makes a new one, with the fused op, and greedy tokens stay those of the split path."""
    from hybrid.layers.hybrid_attention import use_fused_decode

    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = _perturbed(BUILDERS["head"](teacher))
    ids, mask = _padded(_rows((6, 4), seed=15))
    split = model.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
    kept = generation._KEPT[model]
    assert use_fused_decode(model) > 0
    try:
        fused = model.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
        assert generation._KEPT[model] is not kept
        assert torch.equal(fused, split)
    finally:
        use_fused_decode(model, on=False)
    model.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
    assert generation._KEPT[model].key[-1] == kept.key[-1]  # back on the split op: the same key as the first
    generation.release(model)


def test_forward_hooks_run_at_every_step(models):
    """A hook (headscope's interventions) sees every forward of the fast path, as on the eager path, and its
    output change is honoured; adding it gives a new kept cache (no CUDA graph with hooks on CUDA)."""
    model = models["head"]
    ids = torch.stack(_rows((5, 5), seed=16))
    model.generate(ids, max_new_tokens=4, **GREEDY)
    before = generation._KEPT[model]
    seen = {True: 0, False: 0}
    path = [True]

    def hook(module, args, out):
        seen[path[0]] += 1
        return out * 0.5

    handle = model.lm_head.register_forward_hook(hook)
    try:
        fast = model.generate(ids, max_new_tokens=4, **GREEDY)
        assert generation._KEPT[model] is not before
        path[0] = False
        eager = model.generate(ids, max_new_tokens=4, static_cache=False, **GREEDY)
    finally:
        handle.remove()
    assert seen == {True: 4, False: 4} and torch.equal(fast, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["head", "teacher"])
def test_gpu_fast_path_replays_a_cuda_graph_and_matches_eager(name, monkeypatch):
    """float32 on CUDA (bf16 could break argmax ties differently): the fast path captures the decode step as a
    CUDA graph, reuses it on the next call, and its greedy tokens equal the eager path's row by row."""
    teacher = tiny_model("qwen3", head_dim=64).to("cuda")
    model = _perturbed(BUILDERS[name](teacher)).to("cuda")
    rows = [r.to("cuda") for r in _rows((40, 23, 70, 23), seed=15)]
    ids, mask = (t.to("cuda") for t in _padded([r.cpu() for r in rows]))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, **GREEDY)
    kept = generation._KEPT[model]
    assert kept.decoder.use_graph and kept.decoder.graph is not None
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=12, **GREEDY), out)
    assert generation._KEPT[model] is kept  # the graph replayed, not captured again
    for b, ref in enumerate(_per_row(model, rows, max_new_tokens=12, **GREEDY)):
        assert out[b, ids.shape[1]:].tolist() == ref.tolist(), b
    handle = model.lm_head.register_forward_hook(lambda m, a, o: None)  # hooks: stepped without the graph
    try:
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=12, **GREEDY), out)
        assert not generation._KEPT[model].decoder.use_graph
    finally:
        handle.remove()
    generation.release(model)
    assert model not in generation._KEPT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fused_gdn_decode_gives_the_eager_paths_greedy_tokens():
    """With the fused GDN decode op (one Triton kernel per branch and step) the fast path's greedy tokens, in
    float32 on CUDA, equal the eager path's row by row: what switching the op on by default needs."""
    from hybrid.layers.hybrid_attention import use_fused_decode

    teacher = tiny_model("qwen3", head_dim=64).to("cuda")
    model = _perturbed(BUILDERS["head"](teacher)).to("cuda")
    rows = [r.to("cuda") for r in _rows((40, 23, 70, 23), seed=16)]
    ids, mask = (t.to("cuda") for t in _padded([r.cpu() for r in rows]))
    assert use_fused_decode(model) > 0
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, **GREEDY)
        assert generation._KEPT[model].decoder.use_graph
    finally:
        use_fused_decode(model, on=False)
    for b, ref in enumerate(_per_row(model, rows, max_new_tokens=12, **GREEDY)):
        assert out[b, ids.shape[1]:].tolist() == ref.tolist(), b
    generation.release(model)
