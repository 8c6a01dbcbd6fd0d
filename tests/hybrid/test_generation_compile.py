"""hybrid.generation: ``generate(compile_decode=True)`` / ``generation_config.compile_decode`` compile the fast
path's decode step (``Decoder(compile=True)``; aot_eager here, inductor in tests/hybrid/test_decoding.py) and give
the uncompiled fast path's tokens."""
import functools

import pytest
import torch

import hybrid.generation as generation
from headscope.mask import HeadMask
from hybrid.convert import from_mask
from hybrid.decoding import Decoder

from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture
def decoders(monkeypatch):
    """The Decoders generate() builds (compiled with aot_eager, fast to trace on the CPU)."""
    import torch._dynamo

    made = []

    def make(*a, **k):
        dec = Decoder(*a, compile_backend="aot_eager", **k)
        made.append(dec)
        return dec

    monkeypatch.setattr(generation, "Decoder", make)
    torch._dynamo.reset()
    yield made
    torch._dynamo.reset()


def test_compile_decode_gives_the_same_tokens_and_is_kept(decoders):
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = from_mask(teacher, HeadMask.for_model(teacher, [(0, 1), (1, 0), (2, 2)])).eval()
    with torch.no_grad():
        for p in model.new_parameters().values():
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(3))  # [B, T]
    plain = model.generate(ids, max_new_tokens=5, **GREEDY)
    assert decoders[-1].compiled is None
    compiled = model.generate(ids, max_new_tokens=5, compile_decode=True, **GREEDY)
    assert decoders[-1].compiled is not None
    assert torch.equal(plain, compiled)
    generation.release(model)
    model.generation_config.compile_decode = True
    try:
        again = model.generate(ids, max_new_tokens=5, **GREEDY)
        assert decoders[-1].compiled is not None and torch.equal(again, plain)
        n = len(decoders)
        model.generate(ids, max_new_tokens=5, **GREEDY)  # the kept cache and compiled Decoder are reused
        assert len(decoders) == n
        model.generate(ids, max_new_tokens=5, compile_decode=False, **GREEDY)  # the keyword wins
        assert decoders[-1].compiled is None
    finally:
        del model.generation_config.compile_decode
        generation.release(model)
    with pytest.raises(ValueError, match="compile_decode must be"):
        model.generate(ids, max_new_tokens=3, compile_decode="yes", **GREEDY)


def test_pdl_decode_reaches_the_decoder_its_kept_key_and_the_tokens_stay(decoders, monkeypatch):
    """generate(pdl_decode=True) / generation_config.pdl_decode: Decoder(pdl=True) (on the CPU it changes nothing:
    the same tokens), kept apart from a Decoder without it; a value other than True / False / None is refused."""
    import hybrid.decoding as decoding

    asked = []
    monkeypatch.setattr(decoding, "pdl_supported", lambda t: asked.append(t) or True)  # as on a Hopper GPU
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = from_mask(teacher, HeadMask.for_model(teacher, [(0, 1), (1, 0), (2, 2)])).eval()
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(4))  # [B, T]
    try:
        plain = model.generate(ids, max_new_tokens=4, **GREEDY)
        assert decoders[-1].pdl is False and not asked
        with_pdl = model.generate(ids, max_new_tokens=4, pdl_decode=True, **GREEDY)
        assert decoders[-1].pdl is True and torch.equal(plain, with_pdl)
        n = len(decoders)
        model.generation_config.pdl_decode = True
        model.generate(ids, max_new_tokens=4, **GREEDY)  # the kept Decoder with PDL is reused
        assert len(decoders) == n
        model.generate(ids, max_new_tokens=4, pdl_decode=False, **GREEDY)  # the keyword wins: a new Decoder
        assert len(decoders) == n + 1 and decoders[-1].pdl is False
    finally:
        model.generation_config.__dict__.pop("pdl_decode", None)
        generation.release(model)
    with pytest.raises(ValueError, match="pdl_decode must be"):
        model.generate(ids, max_new_tokens=3, pdl_decode="on", **GREEDY)
