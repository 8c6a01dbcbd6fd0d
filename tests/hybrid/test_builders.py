"""Baselines from the same builder: layer-wise masks and hybrids, the token-level hybrid."""
import pytest
import torch

from hybrid.cache import cache_nbytes
from hybrid.config import HybridConfigError
from hybrid.builders import from_layers, from_token_level, layerwise_mask
from hybrid.layers.token_attention import TokenHybridAttention

from model_factories import tiny_model
from testing_utils import assert_close


def test_layerwise_mask_spacing():
    teacher = tiny_model("llama", num_hidden_layers=8)
    mask = layerwise_mask(teacher, "3:1")
    assert mask.per_layer_counts() == [0, 0, 0, 4, 0, 0, 0, 4]
    assert layerwise_mask(teacher, "1:1").per_layer_counts() == [0, 4] * 4
    with pytest.raises(ValueError, match="LA:FA"):
        layerwise_mask(teacher, "three to one")


def test_layerwise_mask_is_selection_layerwise_and_keeps_the_documented_placement():
    from headscope.selection import layerwise

    teacher = tiny_model("llama", num_hidden_layers=28)
    mask = layerwise_mask(teacher, "3:1")
    assert sorted({h.layer for h in mask.fa_heads}) == list(range(3, 28, 4))  # 3, 7, ..., 27
    assert mask.fa_heads == layerwise(teacher, "3:1").fa_heads


def test_no_import_cycle_and_layer_modules_do_not_import_the_builders():
    """Each module imports on its own in a fresh process; the layers never pull in convert or the builders."""
    import subprocess
    import sys

    for first in ("hybrid.layers.token_attention", "hybrid.modeling", "hybrid.convert", "hybrid.builders"):
        code = (f"import sys, importlib; importlib.import_module({first!r}); "
                "print(sorted(m for m in ('hybrid.convert', 'hybrid.builders') if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        if first in ("hybrid.layers.token_attention", "hybrid.modeling"):
            assert out.strip() == "[]", (first, out)


def test_from_layers_builds_whole_layer_hybrid():
    teacher = tiny_model("llama")
    model = from_layers(teacher, fa_layers=[1])
    kinds = [(l.self_attn.fa is not None, l.self_attn.la is not None) for l in model.model.layers]
    assert kinds == [(False, True), (True, False), (False, True)]
    assert model.config.options.granularity == "layer"
    assert torch.isfinite(model(torch.randint(0, 128, (1, 8))).logits).all()
    with pytest.raises(HybridConfigError, match="outside"):
        from_layers(teacher, fa_layers=[5])


def test_token_level_window_cache_and_decoding():
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = from_token_level(teacher, window=4)
    assert all(isinstance(l.self_attn, TokenHybridAttention) for l in model.model.layers)
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :6])
        cache, steps = out.hybrid_cache, [out.logits]
        for i in range(6, 11):
            steps.append(model(ids[:, i:i + 1], hybrid_cache=cache).logits)
    assert_close("token-level incremental", torch.cat(steps, 1), full, "fp64_exact")
    assert cache.layers[0].keys.shape[1] == 3 and cache.layers[0].key_start == 8  # last window-1 positions
    assert cache_nbytes(model, 11, batch=2, dtype=torch.float64)["fa_kv"] == cache.nbytes()["fa_kv"]


def test_token_level_window_limits_attention():
    teacher = tiny_model("qwen3")
    model = from_token_level(teacher, window=3)
    ids = torch.randint(0, 128, (1, 10))
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % 128
    swa = model.model.layers[0].self_attn.swa
    x, y = model.model.embed_tokens(ids), model.model.embed_tokens(changed)
    pos = torch.arange(10)
    cos, sin = model.model.rotary_emb(pos, x.dtype)
    with torch.no_grad():
        a, b = swa(x, pos, cos, sin, None), swa(y, pos, cos, sin, None)
    assert not torch.allclose(a[:, :3], b[:, :3]) and torch.equal(a[:, 3:], b[:, 3:])  # token 0 out of reach from 3 on
