"""The patching backends by name: a new backend is one ``register_backend`` call (and its test).

    register_backend("mine", lambda model, hf, batch_size: MyBackend(hf), detect=is_my_wrapper)
    score(model, "niah", backend="mine")                  # or backend="auto": detect() picks it

Receiver backends (``BACKENDS``, used by ``headscope.score``): ``factory(model, hf, batch_size)`` gets the
object the user passed (a HF model or a wrapper around one), the Hugging Face model inside it, and the
micro-batch size (None: automatic), and returns an object with the ``patching.engine.Backend`` methods.
``detect(model) -> bool`` makes "auto" choose the backend for such models; "auto" falls back to "hf".

Path backends (``PATH_BACKENDS``, used by ``sender_scores`` / ``iterated_path_patching``):
``factory(hf, receivers, batch_size)`` returns a backend whose ``patched_metrics`` gives M_path per sender.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

__all__ = ["BACKENDS", "PATH_BACKENDS", "register_backend", "register_path_backend", "make_backend",
           "make_path_backend", "resolve_backend", "check_path_backend", "AUTO", "DEFAULT_BACKEND"]

AUTO = "auto"
DEFAULT_BACKEND = "hf"  # what "auto" picks when no detect() claims the model


@dataclass(frozen=True)
class BackendEntry:
    factory: Callable[..., Any]
    detect: Callable[[Any], bool] | None = None


BACKENDS: dict[str, BackendEntry] = {}
PATH_BACKENDS: dict[str, BackendEntry] = {}


def _check_name(name: Any, factory: Any, kind: str) -> None:
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"{kind} backend name {name!r}: give a non-empty string other than {AUTO!r}")
    if not callable(factory):
        raise TypeError(f"the factory of {kind} backend {name!r} is {factory!r}; give a callable")


def register_backend(name: str, factory: Callable[[Any, nn.Module, int | None], Any], *,
                     detect: Callable[[Any], bool] | None = None) -> None:
    """Make ``score(..., backend=name)`` use ``factory(model, hf, batch_size)``; re-registering replaces."""
    _check_name(name, factory, "receiver")
    if detect is not None and not callable(detect):
        raise TypeError(f"detect of backend {name!r} is {detect!r}; give a callable model -> bool or None")
    BACKENDS[name] = BackendEntry(factory, detect)


def register_path_backend(name: str, factory: Callable[[nn.Module, Any, int | None], Any]) -> None:
    """Make ``sender_scores(..., backend=name)`` use ``factory(hf, receivers, batch_size)``."""
    _check_name(name, factory, "path")
    PATH_BACKENDS[name] = BackendEntry(factory)


def _choices(registry: dict, auto: bool) -> list[str]:
    return ([AUTO] if auto else []) + sorted(registry)


def resolve_backend(model: Any, backend: str) -> str:
    """The registered name that ``backend`` means for ``model`` ("auto": the detecting backend, else "hf")."""
    if backend != AUTO and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {_choices(BACKENDS, True)} (or register_backend)")
    if backend == AUTO:
        claimed = [name for name, entry in BACKENDS.items() if entry.detect is not None and entry.detect(model)]
        return claimed[0] if claimed else DEFAULT_BACKEND
    return backend


def make_backend(model: Any, hf: nn.Module, backend: str, batch_size: int | None) -> Any:
    return BACKENDS[resolve_backend(model, backend)].factory(model, hf, batch_size)


def check_path_backend(backend: str) -> None:
    if backend not in PATH_BACKENDS:
        raise ValueError(f"backend={backend!r}; path patching supports {_choices(PATH_BACKENDS, False)} "
                         "(or register_path_backend)")


def make_path_backend(hf: nn.Module, receivers: Any, backend: str, batch_size: int | None) -> Any:
    check_path_backend(backend)
    return PATH_BACKENDS[backend].factory(hf, receivers, batch_size)


# ---- the built-in backends -------------------------------------------------------------------------
def _hf(model: Any, hf: nn.Module, batch_size: int | None):
    from headscope.patching.hf import HFBackend, HFFastConfig

    return HFBackend(hf, HFFastConfig(batch_size=batch_size))


def _naive(model: Any, hf: nn.Module, batch_size: int | None):
    from headscope.patching.engine import NaiveBackend

    return NaiveBackend(hf)


def _transformer_lens(model: Any, hf: nn.Module, batch_size: int | None):
    from headscope.patching.tl import TLBackend, is_transformer_bridge

    if not is_transformer_bridge(model):
        raise TypeError("backend='transformer_lens' needs a TransformerBridge: "
                        "headscope.patching.tl.bridge_from_hf(model, tokenizer)")
    return TLBackend(model, batch_size)


def _nnsight(model: Any, hf: nn.Module, batch_size: int | None):
    from headscope.patching.nn_sight import NNsightBackend, is_nnsight_model

    if not is_nnsight_model(model):
        raise TypeError("backend='nnsight' needs an nnsight model: nnsight.NNsight(model) or LanguageModel")
    return NNsightBackend(model, batch_size)


def _is_bridge(model: Any) -> bool:
    from headscope.patching.tl import is_transformer_bridge

    return is_transformer_bridge(model)


def _is_nnsight(model: Any) -> bool:
    from headscope.patching.nn_sight import is_nnsight_model

    return is_nnsight_model(model)


def _hf_path(hf: nn.Module, receivers: Any, batch_size: int | None):
    from headscope.patching.hf import HFFastConfig
    from headscope.patching.path import HFPathBackend

    return HFPathBackend(hf, receivers, HFFastConfig(batch_size=batch_size))


def _naive_path(hf: nn.Module, receivers: Any, batch_size: int | None):
    from headscope.patching.path import NaivePathBackend

    return NaivePathBackend(hf, receivers)


register_backend("hf", _hf)
register_backend("naive", _naive)
register_backend("transformer_lens", _transformer_lens, detect=_is_bridge)
register_backend("nnsight", _nnsight, detect=_is_nnsight)
register_path_backend("hf", _hf_path)
register_path_backend("naive", _naive_path)
