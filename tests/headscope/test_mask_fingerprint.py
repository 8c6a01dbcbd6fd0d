"""The config fingerprint a mask carries: RoPE settings count (wherever the transformers version keeps them), and
masks written with the legacy fingerprint (before RoPE settings were hashed) still fit their model."""
import dataclasses
import json

import pytest

from headscope import HeadMask, MaskError
from headscope.mask import config_fingerprint, fingerprint_matches, legacy_config_fingerprint, rope_parameters
from model_factories import tiny_config


def _qwen3(theta: float, scaling: dict | None = None):
    cfg = tiny_config("qwen3")
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    return cfg


def test_rope_base_changes_the_fingerprint_under_transformers_5():
    a, b = _qwen3(10000.0), _qwen3(1_000_000.0)
    assert "rope_theta" not in a.to_dict()  # transformers 5 keeps it in rope_parameters only
    assert legacy_config_fingerprint(a) == legacy_config_fingerprint(b)  # the legacy hash could not tell them apart
    assert config_fingerprint(a) != config_fingerprint(b)
    yarn = _qwen3(10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
    assert config_fingerprint(yarn) != config_fingerprint(a)


def test_the_same_rope_settings_hash_alike_in_either_layout():
    arch = {"model_type": "llama", "vocab_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 256}
    v4 = {**arch, "rope_theta": 10000, "rope_scaling": None}  # transformers 4's config.json
    v5 = {**arch, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert rope_parameters(v4) == rope_parameters(v5) == {"rope_type": "default", "rope_theta": 10000.0}
    assert config_fingerprint(v4) == config_fingerprint(v5)
    v4_scaled = {**v4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    v5_scaled = {**arch, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    assert config_fingerprint(v4_scaled) == config_fingerprint(v5_scaled) != config_fingerprint(v4)


def test_a_model_without_rope_keeps_its_fingerprint():
    gpt2 = tiny_config("gpt2")
    assert rope_parameters(gpt2) is None
    assert config_fingerprint(gpt2) == legacy_config_fingerprint(gpt2)


def test_masks_with_the_legacy_fingerprint_still_fit_their_model(tmp_path):
    cfg = _qwen3(10000.0)
    mask = HeadMask.for_model(cfg, [(0, 1), (1, 2), (2, 3)])
    assert mask.fingerprint == config_fingerprint(cfg) != legacy_config_fingerprint(cfg)
    old = dataclasses.replace(mask, fingerprint=legacy_config_fingerprint(cfg))
    old.to_json(tmp_path / "old.json")
    assert json.loads((tmp_path / "old.json").read_text())["model"]["config_fingerprint"] == \
        legacy_config_fingerprint(cfg)
    back = HeadMask.from_json(tmp_path / "old.json")
    back.validate_for(cfg)  # the legacy fingerprint is accepted
    assert fingerprint_matches(cfg, back.fingerprint) and fingerprint_matches(cfg, mask.fingerprint)
    other = tiny_config("qwen3", intermediate_size=96)
    with pytest.raises(MaskError, match="fingerprint"):
        back.validate_for(other)


def test_a_mask_of_another_rope_base_is_refused():
    mask = HeadMask.for_model(_qwen3(10000.0), [(0, 1), (1, 2), (2, 3)])
    with pytest.raises(MaskError, match="fingerprint"):
        mask.validate_for(_qwen3(500000.0))
    mask.validate_for(_qwen3(500000.0), check_fingerprint=False)


def test_the_shipped_masks_fingerprints_still_match():
    """Masks written before RoPE settings were hashed (the reference head report's) fit the shipped model."""
    from pathlib import Path

    from headscope.reference import default_path

    root = Path(__file__).resolve().parents[2]
    path = root / "docs/results/2026-11-29_reference_head_report/reference_mask_7to1.json"
    if not path.is_file() or not (default_path() / "config.json").is_file():
        pytest.skip("the reference mask or model config is not in this checkout")
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(default_path()), local_files_only=True)
    HeadMask.from_json(path).validate_for(cfg)
