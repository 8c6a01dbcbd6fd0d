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

from headscope.registry import Registry

__all__ = ["BACKENDS", "PATH_BACKENDS", "register_backend", "register_path_backend", "make_backend",
           "make_path_backend", "resolve_backend", "check_path_backend", "AUTO", "DEFAULT_BACKEND"]

AUTO = "auto"
DEFAULT_BACKEND = "hf"  # what "auto" picks when no detect() claims the model


@dataclass(frozen=True)
class BackendEntry:
    factory: Callable[..., Any]
    detect: Callable[[Any], bool] | None = None


BACKENDS: Registry[BackendEntry] = Registry("patching backend",
                                            owner="headscope.patching.backends.BACKENDS")
PATH_BACKENDS: Registry[BackendEntry] = Registry("path-patching backend",
                                                 owner="headscope.patching.backends.PATH_BACKENDS")


def _check(name: Any, factory: Any, detect: Any, kind: str) -> None:
    if name == AUTO:
        raise ValueError(f"{kind} name {AUTO!r} is reserved: it means 'pick from the model'; choose another name")
    if not callable(factory):
        raise TypeError(f"the factory of {kind} {name!r} is {factory!r}; give a callable")
    if detect is not None and not callable(detect):
        raise TypeError(f"detect of {kind} {name!r} is {detect!r}; give a callable model -> bool, or None")


def register_backend(name: str, factory: Callable[[Any, nn.Module, int | None], Any], *,
                     detect: Callable[[Any], bool] | None = None, overwrite: bool = False) -> BackendEntry:
    """Make ``score(..., backend=name)`` use ``factory(model, hf, batch_size)`` (a taken name needs overwrite=True)."""
    _check(name, factory, detect, BACKENDS.kind)
    return BACKENDS.register(name, BackendEntry(factory, detect), overwrite=overwrite)


def register_path_backend(name: str, factory: Callable[[nn.Module, Any, int | None], Any], *,
                          overwrite: bool = False) -> BackendEntry:
    """Make ``sender_scores(..., backend=name)`` use ``factory(hf, receivers, batch_size)`` (a taken name needs
    overwrite=True)."""
    _check(name, factory, None, PATH_BACKENDS.kind)
    return PATH_BACKENDS.register(name, BackendEntry(factory), overwrite=overwrite)


def resolve_backend(model: Any, backend: str) -> str:
    """The registered name that ``backend`` means for ``model`` ("auto": the detecting backend, else "hf")."""
    if backend == AUTO:
        claimed = [name for name, entry in BACKENDS.items() if entry.detect is not None and entry.detect(model)]
        return claimed[0] if claimed else DEFAULT_BACKEND
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {(AUTO, *BACKENDS.names())}; add one with "
                         "headscope.register_backend(name, factory)")
    return backend


def make_backend(model: Any, hf: nn.Module, backend: str, batch_size: int | None) -> Any:
    return BACKENDS[resolve_backend(model, backend)].factory(model, hf, batch_size)


def check_path_backend(backend: str) -> None:
    if backend not in PATH_BACKENDS:
        raise ValueError(f"backend={backend!r}: path patching supports {PATH_BACKENDS.names()}; add one with "
                         "headscope.patching.backends.register_path_backend(name, factory)")


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
