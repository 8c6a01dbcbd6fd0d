"""HeadScores: a short repr, and persistence through headscope.io."""
import torch

from headscope.results import HeadScores


def test_repr_is_a_short_summary():
    ps = torch.zeros(5, 3, 4, dtype=torch.float64)
    ps[:, 2, 1], ps[:, 0, 3] = 0.8, 0.25
    s = HeadScores("niah", ps, n_kv_heads=2)
    text = repr(s)
    assert text.startswith("HeadScores(kind='receiver', task='niah', 3 layers x 4 heads, n_kv_heads=2, n_samples=5")
    assert "top 5: L2H1=0.800, L0H3=0.250, L0H0=0.000" in text
    assert "tensor" not in text and len(text) < 300 and str(s) == text
    big = HeadScores("niah", torch.rand(16, 28, 16))
    assert len(repr(big)) < 300
    ps[0, 0, 0] = float("nan")
    assert "non-finite" in repr(HeadScores("niah", ps))


def test_to_json_writes_atomically_and_round_trips(tmp_path):
    s = HeadScores("niah", torch.rand(2, 3, 4), n_kv_heads=2, settings={"seed": 0})
    path = tmp_path / "sub" / "scores.json"
    s.to_json(path)
    back = HeadScores.from_json(path)
    torch.testing.assert_close(back.per_sample_raw, s.per_sample_raw)
    assert back.n_kv_heads == 2 and [p.name for p in path.parent.iterdir()] == ["scores.json"]  # no temp file left


def test_from_json_refuses_ragged_rows_and_strings_naming_the_row(tmp_path):
    import json

    import pytest

    s = HeadScores("niah", torch.rand(2, 3, 4), clean_metric=torch.rand(2))
    d = s.to_dict()
    d["per_sample_raw"][1][2] = d["per_sample_raw"][1][2][:3]  # a short row
    path = tmp_path / "short.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"per_sample_raw\[1\]\[2\] has 3 entries where 4 were expected") as e:
        HeadScores.from_json(path)
    assert str(path) in str(e.value) and "[samples][layers][heads]" in str(e.value)
    d = s.to_dict()
    d["per_sample_raw"][0][1][2] = "0.5"
    with pytest.raises(ValueError, match=r"holds '0.5' \(str\) at per_sample_raw\[0\]\[1\]\[2\]"):
        HeadScores.from_json(json.dumps(d))
    d = s.to_dict()
    d["clean_metric"] = [1.0]
    with pytest.raises(ValueError, match="'clean_metric' has 1 entries but per_sample_raw has 2 sample"):
        HeadScores.from_json(json.dumps(d))
    d = s.to_dict()
    del d["per_sample_raw"]
    with pytest.raises(ValueError, match="'per_sample_raw' field is missing"):
        HeadScores.from_json(json.dumps(d))
    d = s.to_dict()
    d["per_sample_raw"][0][0][0] = float("nan")  # a NaN is a number: read back, not refused here
    assert HeadScores.from_json(json.dumps(d)).n_samples == 2
