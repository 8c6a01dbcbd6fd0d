"""hybrid: head-level full-attention / Gated DeltaNet hybrids built from a head mask.

``import hybrid`` registers ``HybridConfig`` / ``HybridModel`` / ``HybridForCausalLM`` (model_type
``headscope_hybrid``) with the ``transformers`` Auto classes, the ecosystem's convention for custom
architectures (flash-linear-attention does the same), so ``AutoModelForCausalLM.from_pretrained(path)`` loads a
saved hybrid, and registers the hybrid's loader with headscope (``headscope.loaders.MODEL_LOADERS``, which
``headscope.load_model`` and ``headscope eval`` consult; the ``headscope.loaders`` entry point in pyproject.toml
makes them import ``hybrid`` for a saved hybrid folder by themselves). Importing changes nothing else: it imports
``transformers`` and the model classes, never a kernel library (fla, flash-attn load on first use); the other names
load lazily.
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
    "calibrate_merge": "hybrid.layers.merge",
}

__all__ = sorted(_EXPORTS)

from headscope.loaders import MODEL_LOADERS as _LOADERS, register_loader as _register_loader  # noqa: E402
from hybrid.folders import MODEL_TYPE as _MODEL_TYPE, check_folder as _check_folder  # noqa: E402
from hybrid.modeling import register as _register  # noqa: E402
# bound eagerly, not through __getattr__: nnsight adds a `save` method to every object once imported, and a module's
# __getattr__ only runs when normal lookup fails, so a lazy `hybrid.save` would resolve to nnsight's
from hybrid.saving import load, save  # noqa: E402

_register()
if _MODEL_TYPE not in _LOADERS:  # headscope.load_model(folder) checks a saved hybrid's folder with check_folder
    _register_loader(_MODEL_TYPE, package="hybrid", check=_check_folder)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
