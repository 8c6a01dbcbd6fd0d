"""hybrid.train.build: compiling a hybrid's layers raises dynamo's recompile limit to cover its layer structures
(past the limit the remaining variants would run eagerly, without a word)."""
from __future__ import annotations

import pytest
import torch

from headscope.mask import HeadMask
from hybrid.convert import from_mask
from hybrid.train.build import compile_decoder_layers, raise_recompile_limit, recompile_limit_for

from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _limit() -> int:
    cfg = torch._dynamo.config
    return getattr(cfg, "recompile_limit", None) or cfg.cache_size_limit


def test_recompile_limit_covers_the_layer_structures():
    teacher = tiny_model("qwen3")
    n = teacher.config.num_hidden_layers
    one = from_mask(teacher, HeadMask.for_model(teacher, [(0, 0)]))  # layer 0 has an FA head, the others none
    assert recompile_limit_for(one.model.layers) == 16 * 2
    every = from_mask(teacher, HeadMask.for_model(teacher, [(i, 0) for i in range(n)]))  # every layer alike
    assert recompile_limit_for(every.model.layers) == 16
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch(**{name: 8}):  # restored afterwards
        assert raise_recompile_limit(4) == 8  # never lowered
        compile_decoder_layers(one)
        assert _limit() == 32
