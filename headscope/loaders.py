"""Loaders for model types that transformers does not know by itself, found by the folder's ``model_type``.

A package that defines such a model registers a loader when it is imported (``hybrid`` does, for its model_type
``headscope_hybrid``):

    from headscope.loaders import register_loader
    register_loader("headscope_hybrid", package="hybrid", check=check_folder)

and declares a packaging entry point in the group ``headscope.loaders`` whose name is the model_type and whose
value is the module that registers it (pyproject.toml)::

    [project.entry-points."headscope.loaders"]
    headscope_hybrid = "hybrid"

``prepare_folder(path)`` (run by ``headscope.load_model`` and ``headscope eval --model``) reads the folder's
config.json; when its model_type has no registered loader, the entry point of that name is imported (found through
``importlib.metadata``: headscope imports no such package by name), which registers the loader and the model's
classes with the transformers Auto classes. The loader's ``check`` then names a broken or incomplete folder with
the fix before transformers reads it. A model_type that neither transformers nor any loader knows is refused
(``UnknownModelTypeError``), naming what to install or import.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from headscope.registry import Registry

__all__ = ["ModelLoader", "MODEL_LOADERS", "ENTRY_POINT_GROUP", "UnknownModelTypeError", "register_loader",
           "loader_for", "folder_model_type", "prepare_folder"]

ENTRY_POINT_GROUP = "headscope.loaders"
_MODEL_TYPE = re.compile(r'"model_type"\s*:\s*"([^"]*)"')


class UnknownModelTypeError(ValueError):
    """A saved model folder whose model_type no installed package can load."""


@dataclass(frozen=True)
class ModelLoader:
    """How headscope loads one model_type: ``package`` (named in messages) and ``check(folder, need_tokenizer=...)``,
    which raises naming a missing or damaged file and the fix (it returns nothing useful; the model itself loads
    through the transformers Auto classes that ``package`` registered when it was imported)."""

    package: str
    check: Callable[..., Any]

    def __post_init__(self) -> None:
        if not isinstance(self.package, str) or not self.package:
            raise ValueError(f"ModelLoader.package={self.package!r}: name the package that defines the model type")
        if not callable(self.check):
            raise TypeError(f"ModelLoader.check={self.check!r}: give a callable check(folder, need_tokenizer=...)")


MODEL_LOADERS: Registry[ModelLoader] = Registry("model loader", owner="headscope.loaders.MODEL_LOADERS")


def register_loader(model_type: str, *, package: str, check: Callable[..., Any],
                    overwrite: bool = False) -> ModelLoader:
    """Load folders whose config.json says ``model_type`` with the classes ``package`` registered; ``check`` runs
    on the folder first. A taken model_type needs ``overwrite=True``."""
    return MODEL_LOADERS.register(model_type, ModelLoader(package, check), overwrite=overwrite)


def _entry_points(model_type: str) -> list:
    from importlib.metadata import entry_points

    return [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == model_type]


def loader_for(model_type: str) -> ModelLoader | None:
    """The registered loader of ``model_type``; when none is registered, the entry points named ``model_type`` in
    the group ``headscope.loaders`` are imported (each registers its loader) and the registry is asked again.
    None when no package declares one."""
    if model_type in MODEL_LOADERS:
        return MODEL_LOADERS[model_type]
    eps = _entry_points(model_type)
    for ep in eps:
        try:
            ep.load()
        except ImportError as err:
            raise UnknownModelTypeError(
                f"model_type {model_type!r} is loaded by the package {ep.value!r} (entry point {ep.name!r} in "
                f"{ENTRY_POINT_GROUP!r}), which failed to import ({err}); reinstall it (pip install -e . for this "
                "repository's packages)") from err
        if model_type in MODEL_LOADERS:
            return MODEL_LOADERS[model_type]
    if eps:
        raise UnknownModelTypeError(
            f"model_type {model_type!r}: the entry point {eps[0].name} = {eps[0].value!r} ({ENTRY_POINT_GROUP!r}) "
            f"imported but registered no loader; it should call headscope.loaders.register_loader({model_type!r}, "
            "package=..., check=...)")
    return None


def _read_config(folder: Path) -> tuple[dict | None, str]:
    """(config.json as a dict or None when it is not valid JSON, its text)."""
    text = (folder / "config.json").read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None, text
    return (data if isinstance(data, dict) else None), text


def folder_model_type(path: str | Path) -> str | None:
    """The model_type in ``path``/config.json (read from the text when the JSON is damaged, so a loader's check
    can name the damage); None when ``path`` is not a folder with a config.json that names one."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        return None
    data, text = _read_config(folder)
    if data is not None:
        model_type = data.get("model_type")
        return model_type if isinstance(model_type, str) and model_type else None
    found = _MODEL_TYPE.search(text)
    return found.group(1) if found and found.group(1) else None


def _known_to_transformers(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def prepare_folder(path: str | Path, *, need_tokenizer: bool = False) -> ModelLoader | None:
    """Make the model saved in the folder ``path`` loadable by the transformers Auto classes, or refuse it.

    Finds the loader of its model_type (``loader_for``: the registry, else the entry point of that name) and runs
    its check (``need_tokenizer``: a tokenizer must be saved alongside). Returns the loader, or None when the
    folder needs none (not a folder with a config.json, a model_type transformers knows, or custom code the
    folder brings itself, ``auto_map``). Raises UnknownModelTypeError for a model_type nothing can load."""
    model_type = folder_model_type(path)
    if model_type is None:
        return None
    loader = loader_for(model_type)
    if loader is not None:
        loader.check(Path(path).expanduser(), need_tokenizer=need_tokenizer)
        return loader
    data, _ = _read_config(Path(path).expanduser())
    if _known_to_transformers(model_type) or (data is not None and "auto_map" in data):
        return None
    known = ", ".join(f"{name} ({MODEL_LOADERS[name].package})" for name in MODEL_LOADERS) or "none registered"
    raise UnknownModelTypeError(
        f"{Path(path) / 'config.json'} says model_type={model_type!r}, which neither transformers nor an installed "
        f"headscope loader knows (loaders: {known}). Install or import the package that defines {model_type!r} "
        f"(a package that declares a {ENTRY_POINT_GROUP!r} entry point named {model_type!r} is imported "
        "automatically; e.g. `pip install -e .` in this repository provides 'headscope_hybrid' through "
        "`hybrid`), or register one with headscope.loaders.register_loader")
