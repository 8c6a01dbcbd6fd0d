"""headscope.loaders: a folder's model_type finds its loader in the registry, else through the
``headscope.loaders`` entry point of that name; a model_type nothing can load is refused naming what to do."""
from __future__ import annotations

import json
from importlib.metadata import EntryPoint

import pytest

from headscope.loaders import (ENTRY_POINT_GROUP, MODEL_LOADERS, UnknownModelTypeError, folder_model_type,
                               loader_for, prepare_folder, register_loader)
from headscope.reference import load_model

from model_factories import tiny_model


def _folder(tmp_path, config: dict | str, name: str = "m"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


@pytest.fixture
def plugin(tmp_path, monkeypatch, request):
    """A module on sys.path whose import registers a loader, declared as an entry point (importlib.metadata's
    entry_points answers with it added to the installed ones)."""
    import importlib.metadata as md

    pkg = tmp_path / "plugins"
    pkg.mkdir()
    (pkg / "fake_loader_plugin.py").write_text(
        "from headscope.loaders import register_loader\n"
        "CHECKED = []\n"
        "register_loader('fake_plugin_type', package='fake_loader_plugin',\n"
        "                check=lambda folder, need_tokenizer=False: CHECKED.append((folder.name, need_tokenizer)))\n")
    (pkg / "silent_plugin.py").write_text("")  # imports, registers nothing
    monkeypatch.syspath_prepend(str(pkg))
    extra = [EntryPoint("fake_plugin_type", "fake_loader_plugin", ENTRY_POINT_GROUP),
             EntryPoint("silent_type", "silent_plugin", ENTRY_POINT_GROUP),
             EntryPoint("broken_type", "no_such_module_headscope_test", ENTRY_POINT_GROUP)]
    installed = md.entry_points

    def entry_points(**kw):
        found = list(installed(**kw))
        return found + [ep for ep in extra if kw.get("group") == ep.group]

    monkeypatch.setattr(md, "entry_points", entry_points)

    def cleanup():
        import sys

        for name in ("fake_plugin_type",):
            if name in MODEL_LOADERS:
                MODEL_LOADERS.unregister(name)
        for mod in ("fake_loader_plugin", "silent_plugin"):
            sys.modules.pop(mod, None)

    request.addfinalizer(cleanup)
    return pkg


def test_the_entry_point_of_a_folders_model_type_is_imported_and_its_check_runs(plugin, tmp_path):
    import sys

    folder = _folder(tmp_path, {"model_type": "fake_plugin_type"}, "saved")
    assert "fake_plugin_type" not in MODEL_LOADERS and "fake_loader_plugin" not in sys.modules
    loader = prepare_folder(folder, need_tokenizer=True)
    assert loader.package == "fake_loader_plugin" and MODEL_LOADERS["fake_plugin_type"] is loader
    assert sys.modules["fake_loader_plugin"].CHECKED == [("saved", True)]
    assert loader_for("fake_plugin_type") is loader  # registered now: no second import
    prepare_folder(folder)
    assert sys.modules["fake_loader_plugin"].CHECKED == [("saved", True), ("saved", False)]


def test_a_registered_loader_is_used_without_entry_points(tmp_path, request):
    seen = []
    register_loader("fake_registered_type", package="mine", check=lambda f, need_tokenizer=False: seen.append(f))
    request.addfinalizer(lambda: MODEL_LOADERS.unregister("fake_registered_type"))
    folder = _folder(tmp_path, {"model_type": "fake_registered_type"})
    assert prepare_folder(folder).package == "mine" and seen == [folder]
    with pytest.raises(ValueError, match="'fake_registered_type' is already registered in "
                                         "headscope.loaders.MODEL_LOADERS: pass overwrite=True"):
        register_loader("fake_registered_type", package="other", check=print)


def test_entry_points_that_cannot_load_are_named(plugin, tmp_path):
    with pytest.raises(UnknownModelTypeError, match="'silent_plugin'.*registered no loader.*register_loader"):
        prepare_folder(_folder(tmp_path, {"model_type": "silent_type"}, "a"))
    with pytest.raises(UnknownModelTypeError, match="package 'no_such_module_headscope_test'.*failed to import"):
        prepare_folder(_folder(tmp_path, {"model_type": "broken_type"}, "b"))


def test_a_model_type_nothing_loads_is_refused_naming_what_to_install(tmp_path):
    folder = _folder(tmp_path, {"model_type": "made_up_type_xyz"})
    with pytest.raises(UnknownModelTypeError, match="model_type='made_up_type_xyz'.*Install or import the package "
                                                    "that defines 'made_up_type_xyz'"):
        prepare_folder(folder)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnknownModelTypeError, match="made_up_type_xyz"):
        load_model(folder)  # refused before transformers reads the folder


def test_folders_that_need_no_loader(tmp_path):
    tiny_model("qwen3").save_pretrained(tmp_path / "q")
    assert folder_model_type(tmp_path / "q") == "qwen3" and prepare_folder(tmp_path / "q") is None
    assert prepare_folder(tmp_path / "nowhere") is None  # not a folder: the caller's own error
    assert prepare_folder(_folder(tmp_path, {"model_type": "own_code_type", "auto_map": {}}, "c")) is None
    assert folder_model_type(_folder(tmp_path, {"vocab_size": 3}, "d")) is None


def test_a_damaged_config_still_names_its_model_type(tmp_path):
    """The model_type is read from the text of a truncated config.json, so the loader's check can name the damage."""
    text = json.dumps({"architectures": ["X"], "model_type": "fake_damaged_type", "vocab_size": 3}, indent=1)
    assert folder_model_type(_folder(tmp_path, text[: len(text) - 12])) == "fake_damaged_type"
