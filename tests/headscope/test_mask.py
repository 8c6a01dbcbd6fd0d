"""HeadMask: JSON round trip and the errors that guard the hand-off to `hybrid`."""
import json
from pathlib import Path

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
    assert data["schema"] == "headscope.head_mask" and data["schema_version"] == 2
    assert data["fa_kv_heads"] == [[1], [], [0]] and data["n_fa_kv"] == 2 and data["kv_cache_share"] == 2 / 6
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
    (dict(scores=[[0.0, float("nan"), 0.0, 0.0]] * 3), "non-finite"),
    (dict(fa_heads=[(0, 1.5)]), r"fa_heads\[0\].*integer"),
    (dict(fa_heads=[("0", 1)]), r"fa_heads\[0\].*integer"),
    (dict(fa_heads=[(0, 1), (True, 1)]), r"fa_heads\[1\].*integer"),
    (dict(fa_heads="L0H1"), "list of heads"),
    (dict(n_kv_heads=True), "n_kv_heads"),
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


# ---- schema versions and derived fields -----------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def test_version_1_files_still_load():
    # written as version 1
    shipped = HeadMask.from_json(REPO / "docs" / "results" / "2026-11-29_reference_head_report" / "reference_mask_7to1.json")
    assert len(shipped) == 8 and shipped.n_kv_heads == 4 and shipped.kv_cache_share == pytest.approx(8 / 32)
    v1 = _mask().to_dict()
    v1["schema_version"] = 1
    for key in ("fa_kv_heads", "n_fa_kv", "kv_cache_share"):
        del v1[key]
    assert HeadMask.from_dict(v1) == _mask()


@pytest.mark.parametrize("field, value, message", [
    ("n_fa", 3, "'n_fa' is 3 but fa_heads"),
    ("ratio_la_fa", "7:1", "'ratio_la_fa' is '7:1'"),
    ("fa_kv_heads", [[0], [], [0]], "'fa_kv_heads'"),
    ("fa_kv_heads", "all", "'fa_kv_heads'"),
    ("n_fa_kv", 5, "'n_fa_kv' is 5"),
    ("kv_cache_share", 0.5, "'kv_cache_share' is 0.5"),
    ("kv_cache_share", "a third", "'kv_cache_share'"),
])
def test_fields_that_contradict_fa_heads_are_refused(field, value, message):
    data = _mask().to_dict()
    data[field] = value
    with pytest.raises(MaskError, match=message):
        HeadMask.from_dict(data)


def test_kv_fields_without_kv_heads_and_bad_heads_in_files_are_refused():
    data = _mask().to_dict()
    data["model"]["n_kv_heads"] = None
    with pytest.raises(MaskError, match="no model.n_kv_heads"):
        HeadMask.from_dict(data)
    for heads, message in [([[0, 1.5]], "integer"), ([["2", 1]], "integer"), ("0,1", "list of"),
                           ([[0, 1, 2]], "cannot read a Head")]:
        data = _mask().to_dict()
        data["fa_heads"], data["n_fa"], data["ratio_la_fa"] = heads, None, None
        for key in ("fa_kv_heads", "n_fa_kv", "kv_cache_share"):
            data[key] = None
        with pytest.raises(MaskError, match=message):
            HeadMask.from_dict(data)
    with pytest.raises(MaskError, match="schema_version"):
        HeadMask.from_dict({**_mask().to_dict(), "schema_version": True})


def test_summary_says_budget_kv_share_layers_best_heads_and_signal():
    m = _mask(scores=[[0.0, 0.0, 0.0, 0.4], [0.0] * 4, [0.0, 0.2, 0.0, 0.0]],
              settings={"strategy": "global", "k": 2, "n_no_signal": 0, "no_signal_heads": []})
    text = m.summary()
    assert "2 of 12 heads kept as full attention (LA:FA 5:1; strategy global)" in text
    assert "KV cache: 2 of 6 KV heads kept (33.3% of the teacher's KV cache)" in text
    assert "FA heads per layer: 1 0 1" in text and "best: L0H3 (0.400), L2H1 (0.200)" in text
    assert "no causal signal: 0 of 2 FA heads" in text and "WARNING" not in text
    assert "not known" in _mask().summary()
