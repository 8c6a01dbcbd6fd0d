"""hybrid: head-level full-attention / Gated DeltaNet hybrids built from a head mask.

Names load lazily, so ``import hybrid`` imports neither ``transformers`` nor any kernel library and
registers nothing (``hybrid.register()`` adds the model to the ``transformers`` Auto classes;
``from_mask`` and ``HybridForCausalLM.from_pretrained`` call it for you).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "from_mask": "hybrid.convert",
    "HybridConfig": "hybrid.config",
    "HybridOptions": "hybrid.config",
    "HybridConfigError": "hybrid.config",
    "HybridForCausalLM": "hybrid.modeling",
    "HybridModel": "hybrid.modeling",
    "register": "hybrid.modeling",
    "HybridCache": "hybrid.cache",
    "cache_nbytes": "hybrid.cache",
    "teacher_cache_nbytes": "hybrid.cache",
    "layerwise_mask": "hybrid.builders",
    "from_layers": "hybrid.builders",
    "from_token_level": "hybrid.builders",
    "from_teacher": "hybrid.builders",
    "calibrate_fusion": "hybrid.layers.fusion",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
