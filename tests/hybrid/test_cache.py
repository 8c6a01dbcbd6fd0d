"""Decoding with HybridCache: prefill + token-by-token equals one full forward; cache sizes."""
import pytest
import torch

from headscope.mask import HeadMask
from hybrid.cache import cache_nbytes, teacher_cache_nbytes
from hybrid.convert import from_mask

from model_factories import tiny_model
from testing_utils import assert_close

FA = [(0, 1), (1, 0), (1, 3), (2, 2)]


def incremental(model, ids, prefill):
    with torch.no_grad():
        out = model(ids[:, :prefill])
        cache, logits = out.hybrid_cache, [out.logits]
        for i in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, i:i + 1], hybrid_cache=cache).logits)
    return torch.cat(logits, 1), cache  # [B, T, V]


@pytest.mark.parametrize("kw", [{}, {"gdn_conv": True, "merge": "gated_branch"}, {"merge": "gated_head"}, {"decay": "simple", "fa_rope": True},
                                {"fa_gate": "none", "merge": "none"}])
def test_incremental_decoding_equals_full_forward(kw):
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = from_mask(teacher, HeadMask.for_model(teacher, FA + [(0, 2)]), **kw)  # layer 0: irregular GQA
    with torch.no_grad():
        for p in model.new_parameters().values():  # off init, so gates, convs and decays matter
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 128, (2, 14))
    full = model(ids, use_cache=False).logits
    inc, cache = incremental(model, ids, prefill=5)
    assert_close("incremental vs full", inc, full, "fp64_exact")
    assert cache.get_seq_length() == 14


def test_cache_holds_only_fa_kv_heads_and_fixed_state():
    teacher = tiny_model("qwen3")
    model = from_mask(teacher, HeadMask.for_model(teacher, FA), gdn_conv=True)
    ids = torch.randint(0, 128, (1, 9))
    _, cache = incremental(model, ids, prefill=4)
    l1 = cache.layers[1]  # FA heads 0 and 3 read KV heads 0 and 1; GDN heads 1, 2
    assert l1.keys.shape == (1, 9, 2, 16) and l1.state.shape == (1, 2, 16, 16) and l1.state.dtype == torch.float32
    l0 = cache.layers[0]  # FA head 1 reads KV head 0 only
    assert l0.keys.shape == (1, 9, 1, 16)
    actual = cache.nbytes()
    predicted = cache_nbytes(model, 9, dtype=torch.float32)
    assert {k: predicted[k] for k in actual} == actual
    assert predicted["teacher"] == teacher_cache_nbytes(teacher, 9, dtype=torch.float32) == 2 * 3 * 2 * 16 * 9 * 4
    big = cache_nbytes(model, 100_000)
    assert big["fa_kv"] * 6 == big["teacher"] * 4  # 4 of the teacher's 6 KV heads (3 layers x 2) kept
