"""HybridOptions / HybridConfig validation: every bad field gets an error naming it."""
import pytest

from hybrid.config import HybridConfig, HybridConfigError, HybridOptions


def shape(**kw):
    base = dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, fa_heads=[[0], [1, 2]])
    base.update(kw)
    return base


@pytest.mark.parametrize("field,value", [("merge", "sum"), ("granularity", "block"), ("fa_gate", "tanh"),
                                         ("decay", "exp"), ("log_scale_base", 1.0), ("conv_size", 0),
                                         ("window", 0), ("gamma_init", 0.0)])
def test_bad_option_names_the_field(field, value):
    with pytest.raises(HybridConfigError, match=field):
        HybridOptions(**{field: value})


def test_unknown_option_is_listed():
    with pytest.raises(HybridConfigError, match="fuson"):
        HybridOptions.from_dict({"fuson": "norm"})


def test_valid_config_and_derived_views():
    cfg = HybridConfig(**shape())
    assert cfg.model_type == "headscope_hybrid"
    assert cfg.n_rep == 2
    assert cfg.la_heads(1) == [0, 3]
    assert cfg.fa_kv_heads(1) == [0, 1]
    assert cfg.options == HybridOptions()
    again = HybridConfig.from_dict(cfg.to_dict())
    assert again.fa_heads == cfg.fa_heads and again.options == cfg.options


def test_bare_config_builds():  # transformers instantiates HybridConfig() to diff configs
    assert HybridConfig().fa_heads == [[], []]


@pytest.mark.parametrize("kw,match", [
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(head_dim=None, hidden_size=30), "not divisible"),
    (dict(fa_heads=[[0]]), "fa_heads has 1 layers"),
    (dict(fa_heads=[[0], [4]]), "outside 0..3"),
    (dict(fa_heads=[[0, 0], [1]]), "twice"),
    (dict(fa_heads=[[], []]), "no full-attention head"),
    (dict(fa_heads=[[0, 1, 2, 3], [0, 1, 2, 3]]), "every head"),
    (dict(fa_heads=[[0], []], hybrid={"require_fa_per_layer": True}), "layers \\[1\\]"),
    (dict(fa_heads=[[0, 1, 2, 3], [1]], hybrid={"granularity": "layer"}), "mix FA and GDN"),
])
def test_bad_shapes_and_masks(kw, match):
    with pytest.raises(HybridConfigError, match=match):
        HybridConfig(**shape(**kw))


def test_odd_head_dim():  # checked before transformers. own rope validation
    with pytest.raises(HybridConfigError, match="head_dim=7 must be a positive even"):
        HybridConfig(**shape(head_dim=7))


def test_degenerate_allowed_on_request():
    cfg = HybridConfig(**shape(fa_heads=[[], []], hybrid={"allow_degenerate": True}))
    assert cfg.la_heads(0) == [0, 1, 2, 3]


def test_the_older_name_fusion_is_read_as_merge():
    """A saved config.json or a training config may say "fusion" (the merge's older name)."""
    assert HybridOptions.from_dict({"fusion": "none"}) == HybridOptions(merge="none")
    assert HybridOptions.from_dict({"fusion": "none", "merge": "none"}).merge == "none"
    with pytest.raises(HybridConfigError, match="both merge='norm' and its older name fusion='none'"):
        HybridOptions.from_dict({"fusion": "none", "merge": "norm"})
    cfg = HybridConfig(**shape(hybrid={"fusion": "gated_head"}))
    assert cfg.options.merge == "gated_head" and cfg.hybrid["merge"] == "gated_head" and "fusion" not in cfg.hybrid
