"""Saving and loading a hybrid the usual ways (hybrid.load, headscope.load_model, AutoModelForCausalLM after
`import hybrid`), the tokenizer saved alongside, and clear errors for broken folders (the file and the fix)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import headscope
import hybrid
from headscope.mask import HeadMask
from hybrid.convert import from_mask
from hybrid.modeling import HybridForCausalLM
from hybrid.saving import HybridFolderError, check_folder

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

FA = [(0, 1), (1, 0), (1, 3), (2, 2)]


@pytest.fixture(scope="module")
def built():
    teacher = tiny_model("qwen3")
    model = from_mask(teacher, HeadMask.for_model(teacher, FA), gdn_conv=True)
    with torch.no_grad():  # off init, so a round trip that dropped them would show
        for p in model.new_parameters().values():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval(), char_tokenizer()


@pytest.fixture
def saved(built, tmp_path):
    model, tok = built
    model.save_pretrained(tmp_path / "h", tokenizer=tok)
    return tmp_path / "h"


@pytest.fixture
def sharded(built, tmp_path):
    model, tok = built
    model.save_pretrained(tmp_path / "s", tokenizer=tok, max_shard_size="100KB")
    assert (tmp_path / "s" / "model.safetensors.index.json").exists()
    return tmp_path / "s"


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_every_loader_gives_back_the_saved_model(built, saved):
    model, tok = built
    ids = torch.randint(3, 128, (1, 9))
    ref = _logits(model, ids)
    assert (saved / "tokenizer.json").exists() or (saved / "tokenizer_config.json").exists()
    alone = hybrid.load(saved)
    assert isinstance(alone, HybridForCausalLM) and not alone.training
    assert torch.equal(_logits(alone, ids), ref)
    loaded, loaded_tok = hybrid.load(saved, with_tokenizer=True)
    assert loaded_tok("ab").input_ids == tok("ab").input_ids and torch.equal(_logits(loaded, ids), ref)
    hs_model, hs_tok = headscope.load_model(saved)
    assert isinstance(hs_model, HybridForCausalLM) and hs_tok("ab").input_ids == tok("ab").input_ids
    assert torch.equal(_logits(hs_model, ids), ref)
    from transformers import AutoModelForCausalLM

    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(saved), ids), ref)


def test_a_partial_rope_hybrid_loads_back_the_same(tmp_path):
    """fa_rope_max_wavelength survives save and load (from_pretrained builds under a meta-device context, where the
    branch still reads its rotary frequencies) and the loaded model gives the same logits."""
    teacher = tiny_model("qwen3")
    model = from_mask(teacher, HeadMask.for_model(teacher, FA), fa_rope=True, fa_rope_max_wavelength=20.0).eval()
    model.save_pretrained(tmp_path / "p", tokenizer=char_tokenizer())
    loaded = hybrid.load(tmp_path / "p")
    kept = {l.self_attn.fa.rope_kept for l in loaded.model.layers}
    assert kept == {l.self_attn.fa.rope_kept for l in model.model.layers} and 0 < min(kept) < model.config.head_dim // 2
    ids = torch.randint(3, 128, (1, 9))
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_hybrid_save_is_save_pretrained_with_the_tokenizer(built, tmp_path):
    model, tok = built
    out = hybrid.save(model, tmp_path / "x", tokenizer=tok)
    assert check_folder(out, need_tokenizer=True) == tmp_path / "x"


@pytest.mark.parametrize("how", ["save_pretrained", "hybrid.save"])
def test_saving_onto_an_existing_file_is_refused_naming_the_path(built, tmp_path, how):
    model, tok = built
    target = tmp_path / "model.bin"
    target.write_text("a file, not a folder")
    with pytest.raises(FileExistsError, match=r"model\.bin: it is an existing file, not a folder; remove it or give"):
        if how == "save_pretrained":
            model.save_pretrained(target, tokenizer=tok)
        else:
            hybrid.save(model, str(target), tokenizer=tok)
    assert target.read_text() == "a file, not a folder"


def test_plain_import_hybrid_registers_the_auto_classes(saved):
    """In a fresh process: `import hybrid` then AutoModelForCausalLM.from_pretrained, nothing else."""
    code = ("import hybrid\nfrom transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(saved)!r})\nprint(type(m).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "HybridForCausalLM"


def test_headscope_loads_a_saved_hybrid_without_being_told_to_import_hybrid(saved, tmp_path):
    """A fresh process that never imports hybrid: headscope.load_model(folder) and `headscope eval --model folder`
    find the hybrid's loader through the headscope.loaders entry point (pyproject.toml), which imports hybrid."""
    code = ("import sys, headscope\n"
            "from headscope.loaders import MODEL_LOADERS\n"
            "assert 'hybrid' not in sys.modules and 'headscope_hybrid' not in MODEL_LOADERS\n"
            f"model, tok = headscope.load_model({str(saved)!r})\n"
            "assert MODEL_LOADERS['headscope_hybrid'].package == 'hybrid'\n"
            "print(type(model).__name__, len(tok))\n"
            "from headscope.cli import main\n"
            f"sys.exit(main(['eval', '--model', {str(saved)!r}, '--suite', 'niah', '--out', "
            f"{str(tmp_path / 'r')!r}, '--quiet', '--set', 'niah.lengths=[200]', '--set', 'niah.depths=[0.5]', "
            "'--set', 'niah.n=1']))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[0].startswith("HybridForCausalLM ")
    assert json.loads((tmp_path / "r" / "results.json").read_text())["model_type"] == "headscope_hybrid"


def test_import_hybrid_changes_nothing_but_the_registration():
    code = ("import torch, transformers\n"
            "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
            "from transformers.models.auto import modeling_auto as ma\n"
            "maps = [ma.MODEL_MAPPING, ma.MODEL_FOR_CAUSAL_LM_MAPPING]\n"
            "before = (set(CONFIG_MAPPING.keys()), [dict(m._extra_content) for m in maps], torch.get_default_dtype())\n"
            "import hybrid\n"
            "assert set(CONFIG_MAPPING.keys()) - before[0] == {'headscope_hybrid'}\n"
            "assert [sorted(c.__name__ for c in m._extra_content) for m in maps] == [['HybridConfig']] * 2\n"
            "assert torch.get_default_dtype() == before[2]\n"
            "import sys; assert not [m for m in ('fla', 'flash_attn', 'plotly', 'nnsight') if m in sys.modules]\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_from_mask_records_its_mask_and_the_saved_hybrid_gives_it_back(built, saved):
    """hybrid.from_mask records the mask in the config (config.head_mask); save -> load brings back the same heads
    and fingerprint, through every loader."""
    model, _ = built
    teacher = tiny_model("qwen3")
    mask = HeadMask.for_model(teacher, FA)
    assert HeadMask.from_dict(model.config.head_mask) == mask
    for loaded in (hybrid.load(saved), headscope.load_model(saved)[0]):
        back = HeadMask.from_dict(loaded.config.head_mask)
        assert back == mask and back.fa_heads == mask.fa_heads and back.fingerprint == mask.fingerprint
        assert back.fingerprint is not None and loaded.config.fa_heads == model.config.fa_heads


def _as_older_save(folder):
    """Rewrite a saved hybrid as older saves have it: the merge called "fusion" in config.json and in the weights."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    save_file({k.replace(".self_attn.merge.", ".self_attn.fusion."): v for k, v in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hybrid"]["fusion"] = cfg["hybrid"].pop("merge")
    (folder / "config.json").write_text(json.dumps(cfg))
    return weights


def test_an_older_save_that_says_fusion_loads(tmp_path):
    """config.json with hybrid.fusion and weights named ...self_attn.fusion.* (the merge's older name) load into the
    same model through every loader; saving again writes the current names."""
    from transformers import AutoModelForCausalLM

    teacher = tiny_model("qwen3")
    model = from_mask(teacher, HeadMask.for_model(teacher, FA), merge="gated_head").eval()
    with torch.no_grad():
        for p in model.new_parameters().values():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "old", tokenizer=char_tokenizer())
    weights = _as_older_save(tmp_path / "old")
    assert any(".self_attn.merge.head_gate." in k for k in weights)
    ids = torch.randint(3, 128, (1, 9))
    ref = _logits(model, ids)
    for loaded in (hybrid.load(tmp_path / "old"), headscope.load_model(tmp_path / "old")[0],
                   AutoModelForCausalLM.from_pretrained(tmp_path / "old")):
        assert loaded.config.options.merge == "gated_head" and "fusion" not in loaded.config.hybrid
        assert torch.equal(_logits(loaded, ids), ref)
    loaded.save_pretrained(tmp_path / "new")
    assert json.loads((tmp_path / "new" / "config.json").read_text())["hybrid"]["merge"] == "gated_head"
    assert torch.equal(_logits(hybrid.load(tmp_path / "new"), ids), ref)
    # a state dict under the older names (an older training checkpoint) loads too, strictly
    fresh = from_mask(teacher, HeadMask.for_model(teacher, FA), merge="gated_head").eval()
    fresh.load_state_dict({k.replace(".self_attn.merge.", ".self_attn.fusion."): v
                           for k, v in model.state_dict().items()}, strict=True)
    assert torch.equal(_logits(fresh, ids), ref)


# ---- broken folders: each names the file and the fix --------------------------------------------------------

def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


BROKEN = {
    "no_config": (lambda d: (d / "config.json").unlink(), "config.json", "save the model again"),
    "truncated_config": (lambda d: _truncate(d / "config.json"), "config.json", "truncated"),
    "no_weights": (lambda d: (d / "model.safetensors").unlink(), "model.safetensors", "save the model again"),
    "truncated_weights": (lambda d: _truncate(d / "model.safetensors", 0.9), "model.safetensors", "truncated"),
    "header_only": (lambda d: _truncate(d / "model.safetensors", 0.0001), "model.safetensors", "truncated"),
}
BROKEN_SHARDED = {
    "missing_shard": (lambda d: sorted(d.glob("model-*.safetensors"))[-1].unlink(), "model-0000", "copy that shard"),
    "truncated_shard": (lambda d: _truncate(sorted(d.glob("model-*.safetensors"))[0], 0.7), "model-00001", "truncated"),
    "truncated_index": (lambda d: _truncate(d / "model.safetensors.index.json"), "model.safetensors.index.json",
                        "truncated"),
    "no_index": (lambda d: (d / "model.safetensors.index.json").unlink(), "no model.safetensors.index.json",
                 "save the model again"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_folder_is_named_with_the_fix(saved, case):
    damage, name, fix = BROKEN[case]
    damage(saved)
    with pytest.raises(HybridFolderError, match=name) as err:
        hybrid.load(saved)
    assert fix in str(err.value)


@pytest.mark.parametrize("case", sorted(BROKEN_SHARDED))
def test_broken_sharded_folder_is_named_with_the_fix(sharded, case):
    damage, name, fix = BROKEN_SHARDED[case]
    damage(sharded)
    with pytest.raises(HybridFolderError, match=name) as err:
        hybrid.load(sharded)
    assert fix in str(err.value)


@pytest.mark.parametrize("loader", ["headscope.load_model", "AutoModelForCausalLM", "HybridForCausalLM"])
def test_every_loader_names_a_truncated_shard(sharded, loader):
    from transformers import AutoModelForCausalLM

    _truncate(sorted(sharded.glob("model-*.safetensors"))[0], 0.7)
    load = {"headscope.load_model": headscope.load_model, "AutoModelForCausalLM": AutoModelForCausalLM.from_pretrained,
            "HybridForCausalLM": HybridForCausalLM.from_pretrained}[loader]
    with pytest.raises(HybridFolderError, match="model-00001.*truncated"):
        load(sharded)


def test_a_folder_without_tokenizer_is_named_when_a_tokenizer_is_asked_for(built, tmp_path):
    model, _ = built
    model.save_pretrained(tmp_path / "m")  # no tokenizer
    assert isinstance(hybrid.load(tmp_path / "m"), HybridForCausalLM)  # the model alone needs none
    for load in (lambda p: hybrid.load(p, with_tokenizer=True), headscope.load_model):
        with pytest.raises(HybridFolderError, match="holds no tokenizer.*save_pretrained\\(path, tokenizer=tok\\)"):
            load(tmp_path / "m")


def test_not_a_hybrid_or_not_a_folder(tmp_path):
    teacher = tiny_model("qwen3")
    teacher.save_pretrained(tmp_path / "t")
    with pytest.raises(HybridFolderError, match="model_type='qwen3'.*AutoModelForCausalLM"):
        hybrid.load(tmp_path / "t")
    with pytest.raises(HybridFolderError, match="does not exist"):
        hybrid.load(tmp_path / "nowhere")
    (tmp_path / "f.json").write_text(json.dumps({}))
    with pytest.raises(HybridFolderError, match="is a file, not a folder"):
        hybrid.load(tmp_path / "f.json")


def test_hybrid_save_is_ours_after_nnsight_is_imported():
    """nnsight patches a `save` method onto every object; hybrid.save must stay hybrid's (found in the full suite)."""
    import nnsight  # noqa: F401

    from hybrid.saving import load, save

    assert hybrid.save is save and hybrid.load is load
