"""hybrid: head-level full-attention / Gated DeltaNet hybrids built from a head mask.

``import hybrid`` registers ``HybridConfig`` / ``HybridModel`` / ``HybridForCausalLM`` (model_type
``headscope_hybrid``) with the ``transformers`` Auto classes, the ecosystem's convention for custom
architectures (flash-linear-attention does the same), so ``AutoModelForCausalLM.from_pretrained(path)`` loads a
saved hybrid. Importing changes nothing else: it imports ``transformers`` and the model classes, never a kernel
library (fla, flash-attn load on first use); the other names load lazily.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "from_mask": "hybrid.convert",
    "load": "hybrid.saving",
    "save": "hybrid.saving",
    "HybridConfig": "hybrid.config",
    "HybridOptions": "hybrid.config",
    "HybridConfigError": "hybrid.config",
    "HybridForCausalLM": "hybrid.modeling",
    "HybridModel": "hybrid.modeling",
    "register": "hybrid.modeling",
    "HybridCache": "hybrid.cache",
    "cache_nbytes": "hybrid.cache",
    "teacher_cache_nbytes": "hybrid.cache",
    "StaticHybridCache": "hybrid.decoding",
    "greedy_decode": "hybrid.decoding",
    "layerwise_mask": "hybrid.builders",
    "from_layers": "hybrid.builders",
    "from_token_level": "hybrid.builders",
    "from_teacher": "hybrid.builders",
    "calibrate_fusion": "hybrid.layers.fusion",
}

__all__ = sorted(_EXPORTS)

from hybrid.modeling import register as _register  # noqa: E402
# bound eagerly, not through __getattr__: nnsight adds a `save` method to every object once imported, and a module's
# __getattr__ only runs when normal lookup fails, so a lazy `hybrid.save` would resolve to nnsight's
from hybrid.saving import load, save  # noqa: E402

_register()


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
