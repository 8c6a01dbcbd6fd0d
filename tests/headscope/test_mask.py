"""HeadMask: JSON round trip and the errors that guard the hand-off to `hybrid`."""
import json

import pytest

from headscope import Head, HeadMask, MaskError
from model_factories import tiny_model


def _mask(**kw):
    base = dict(n_layers=3, n_heads=4, n_kv_heads=2, fa_heads=[(2, 1), Head(0, 3)])
    base.update(kw)
    return HeadMask(**base)


def test_heads_are_sorted_values_and_queries_work():
    m = _mask()
    assert m.fa_heads == (Head(0, 3), Head(2, 1))
    assert m.fa_in_layer(2) == (1,) and m.la_in_layer(2) == (0, 2, 3)
    assert m.per_layer_counts() == [1, 0, 1] and m.ratio == "5:1" and len(m) == 2
    assert m.is_fa(0, 3) and not m.is_fa(1, 0) and (2, 1) in m
    assert m.to_tensor().sum().item() == 2


def test_json_round_trip_keeps_everything(tmp_path):
    m = _mask(scores=[[0.1] * 4] * 3, settings={"strategy": "global", "k": 2})
    path = tmp_path / "mask.json"
    m.to_json(path)
    data = json.loads(path.read_text())
    assert data["schema"] == "headscope.head_mask" and data["schema_version"] == 1
    assert data["headscope_version"] and data["fa_heads"] == [[0, 3], [2, 1]]
    back = HeadMask.from_json(path)
    assert back == m


@pytest.mark.parametrize("kw, message", [
    (dict(fa_heads=[(0, 1), (0, 1)]), "twice"),
    (dict(fa_heads=[(3, 0)]), "outside a model"),
    (dict(fa_heads=[(0, 4)]), "outside a model"),
    (dict(n_heads=0), "n_heads"),
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(scores=[[0.0] * 4] * 2), "scores"),
])
def test_malformed_masks_are_refused(kw, message):
    with pytest.raises(MaskError, match=message):
        _mask(**kw)


def test_bad_files_are_refused(tmp_path):
    with pytest.raises(MaskError, match="does not exist"):
        HeadMask.from_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(MaskError, match="not valid JSON"):
        HeadMask.from_json(bad)
    data = _mask().to_dict()
    with pytest.raises(MaskError, match="schema_version"):
        HeadMask.from_dict({**data, "schema_version": 99})
    with pytest.raises(MaskError, match="schema"):
        HeadMask.from_dict({**data, "schema": "something.else"})
    del data["fa_heads"]
    with pytest.raises(MaskError, match="fa_heads"):
        HeadMask.from_dict(data)


def test_validate_for_a_model():
    model = tiny_model("qwen3")  # 3 layers x 4 heads, 2 KV heads
    m = HeadMask.for_model(model, [(0, 1), (1, 2), (2, 3)])
    m.validate_for(model, require_fa_per_layer=True)
    with pytest.raises(MaskError, match="3 x 4"):
        HeadMask(n_layers=2, n_heads=4, fa_heads=[(0, 1)]).validate_for(model)
    with pytest.raises(MaskError, match="no full-attention head"):
        HeadMask.for_model(model, [(0, 1)]).validate_for(model, require_fa_per_layer=True)
    other = tiny_model("qwen3", intermediate_size=96)
    with pytest.raises(MaskError, match="fingerprint"):
        m.validate_for(other)
    m.validate_for(other, check_fingerprint=False)
