"""Head values: integer indices only, never truncated or parsed."""
import numpy as np
import pytest
import torch

from headscope.heads import Head


def test_accepted_forms():
    assert Head.from_any((1, 2)) == Head.from_any([1, 2]) == Head.from_any({"layer": 1, "head": 2}) == Head(1, 2)
    assert Head.from_any((np.int64(1), torch.tensor(2))) == Head(1, 2)  # integer types from numpy / torch
    h = Head(3, 5)
    assert Head.from_any(h) is h and str(h) == "L3H5" and h.kv_group(8, 2) == 1


@pytest.mark.parametrize("value, message", [
    ((1.5, 2), "integer, got 1.5"),
    ((2.0, 1), "integer, got 2.0"),  # not silently truncated, even when whole
    (("3", 1), "integer, got '3'"),
    ((1, "2"), "head index must be an integer"),
    ((True, 1), "integer, got True"),
    ((np.float64(1.0), 1), "integer"),
    ((torch.tensor(1.0), 1), "integer"),
    ({"layer": 1.5, "head": 0}, "integer"),
    ({"layer": 1}, "missing"),
    ((1, 2, 3), "cannot read a Head"),
    ("L1H2", "cannot read a Head"),
])
def test_non_integer_heads_are_refused(value, message):
    with pytest.raises(TypeError, match=message):
        Head.from_any(value)


@pytest.mark.parametrize("kw, error", [(dict(layer=1.0, head=0), TypeError), (dict(layer=-1, head=0), ValueError)])
def test_head_constructor_refuses_bad_values(kw, error):
    with pytest.raises(error):
        Head(**kw)
