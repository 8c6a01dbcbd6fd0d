"""headscope.arch: the layout registry that tells describe() where a model's heads are."""
from __future__ import annotations

import pytest
import torch.nn as nn

from headscope.arch import LAYOUTS, UnsupportedModelError, describe
from model_factories import tiny_model


class _Renamed(nn.Module):
    """A Llama whose decoder layers sit under another path (decoder.blocks), as a new architecture would."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.config = inner.config
        self.decoder = nn.Module()
        self.decoder.blocks = inner.model.layers


def test_a_new_layout_is_one_registry_entry():
    model = _Renamed(tiny_model("llama"))
    with pytest.raises(UnsupportedModelError):
        describe(model)
    LAYOUTS.register("renamed_llama", ("decoder.blocks", "self_attn", "o_proj"))
    try:
        arch = describe(model)
        assert arch.layout == "renamed_llama" and arch.n_layers == len(model.decoder.blocks)
    finally:
        LAYOUTS.unregister("renamed_llama")


def test_a_built_in_layout_is_not_replaced_silently():
    with pytest.raises(ValueError, match="overwrite=True"):
        LAYOUTS.register("llama", ("x", "y", "z"))
    assert LAYOUTS["llama"] == ("model.layers", "self_attn", "o_proj")
