"""research.studies caches keyed on the teacher's fingerprint: a cache written before the fingerprint hashed RoPE
settings (its key holds headscope.mask.legacy_config_fingerprint) is reused; another teacher's is not."""
from __future__ import annotations

import json

import pytest
import torch

from headscope.mask import config_fingerprint, legacy_config_fingerprint
from research.studies.variants import VariantSpec, build_variant, selection_scores
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def fake_score(teacher):
    from headscope.results import HeadScores

    L, H = teacher.config.num_hidden_layers, teacher.config.num_attention_heads

    def score(model, task, **kw):
        raw = torch.zeros(2, L, H)
        raw[:, 1, 2:4] = 0.8 if task == "niah" else 0.4
        return HeadScores(task=task, per_sample_raw=raw, n_kv_heads=3, settings={"clean_accuracy": 1.0})

    return score


def rewrite_teacher(path, fingerprint, *keys):
    """Record ``fingerprint`` as the teacher's in the cache file's key (under ``keys``)."""
    data = json.loads(path.read_text())
    where = data
    for k in keys:
        where = where[k]
    where["teacher"] = fingerprint
    path.write_text(json.dumps(data))


def test_selection_scores_cached_under_the_legacy_fingerprint_are_reused(tmp_path, monkeypatch):
    import headscope.api

    teacher = tiny_model("llama", num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3,
                         hidden_size=48, head_dim=8)
    assert config_fingerprint(teacher) != legacy_config_fingerprint(teacher)
    path = tmp_path / "s.json"
    monkeypatch.setattr(headscope.api, "score", fake_score(teacher))
    first = selection_scores(teacher, None, n_samples=2, context_length=64, path=path, progress=False,
                             sender_rounds=0)
    assert first.settings["study_key"]["teacher"] == config_fingerprint(teacher)

    def scored_again(*a, **k):
        raise RuntimeError("scored again")

    monkeypatch.setattr(headscope.api, "score", scored_again)
    rewrite_teacher(path, legacy_config_fingerprint(teacher), "settings", "study_key")
    again = selection_scores(teacher, None, n_samples=2, context_length=64, path=path, progress=False,
                             sender_rounds=0)
    assert torch.equal(again.scores, first.scores)
    other = tiny_model("llama", num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3,
                       hidden_size=48, head_dim=8, intermediate_size=40)
    assert legacy_config_fingerprint(other) != legacy_config_fingerprint(teacher)
    rewrite_teacher(path, legacy_config_fingerprint(other), "settings", "study_key")
    with pytest.raises(RuntimeError, match="scored again"):  # another teacher's cache
        selection_scores(teacher, None, n_samples=2, context_length=64, path=path, progress=False, sender_rounds=0)


def test_selector_gates_cached_under_the_legacy_fingerprint_are_reused(tiny_teacher_dir, tmp_path, monkeypatch):
    import research.studies.selector as selector
    from hybrid.train.build import load_teacher
    from hybrid.train.config import DataConfig
    from research.studies.variants import SELECTOR_FILE, BuildContext

    teacher, tok = load_teacher(str(tiny_teacher_dir), torch.device("cpu"))
    assert config_fingerprint(teacher) != legacy_config_fingerprint(teacher)
    s = VariantSpec(name="learned", kind="learned", unit="kv_group", fraction=0.25, selector={"steps": 2})
    data = DataConfig(corpus="heldout", text=1.0, niah=0.0, multikey=0.0, reasoning=0.0, copy=0.0)
    ctx = BuildContext(tokenizer=tok, data=data, folder=tmp_path,
                       selector={"batch_size": 1, "seq_len": 32, "progress": False})
    b = build_variant(s, teacher, seed=3, context=ctx)

    def trained_again(*a, **k):
        raise RuntimeError("trained again")

    monkeypatch.setattr(selector, "train_selector", trained_again)
    rewrite_teacher(tmp_path / SELECTOR_FILE, legacy_config_fingerprint(teacher), "key")
    again = build_variant(s, teacher, seed=3, context=ctx)
    assert again.mask.fa_heads == b.mask.fa_heads
    rewrite_teacher(tmp_path / SELECTOR_FILE, "0123456789abcdef", "key")
    with pytest.raises(RuntimeError, match="trained again"):  # another teacher's gates
        build_variant(s, teacher, seed=3, context=ctx)
