"""The models a run trains: the teacher and the hybrid built from it and the mask, or a fresh model
("pretrain"); the run's identity (what a checkpoint folder must match); the final save.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

__all__ = ["load_teacher", "build_hybrid", "build_pretrain_model", "save_final", "load_tokenizer", "compile_decoder_layers",
           "compiled_submodules", "copy_model"]


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    from headscope.reference import DEFAULT_NAME, default_path

    src = default_path() if name_or_path == DEFAULT_NAME else name_or_path
    tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_teacher(name_or_path: str, device: torch.device, tokenizer: str | None = None):
    """(teacher in eval mode with no gradients, tokenizer): a headscope.load_model name or a model folder."""
    from headscope.reference import load_model

    teacher, tok = load_model(name_or_path, device=device)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.eval(), tok


def build_hybrid(teacher: nn.Module, mask_path: str, options: dict[str, Any]):
    """(hybrid, mask): ``hybrid.from_mask`` (refuses a mask whose fingerprint is another model's; records the mask
    in the hybrid's config, ``config.head_mask``, so the saved hybrid carries it)."""
    from headscope.mask import HeadMask
    from hybrid.convert import from_mask

    mask = HeadMask.from_json(mask_path)
    model = from_mask(teacher, mask, **options)
    return model.train(), mask


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


def compile_decoder_layers(model: nn.Module, mode: str = "default") -> int:
    """``torch.compile`` each decoder layer in place (``nn.Module.compile``: parameter names, state dicts and
    checkpoints are unchanged; fla's Triton kernels, the GDN prologue's Triton launcher and flash-attn are
    compiler-disabled, so graph breaks). ``mode``: torch.compile's ("reduce-overhead": CUDA graphs of the
    compiled regions, for a step whose GPU waits on the host; on CPU it compiles without graphs). Layers of one
    structure share their compiled code; returns how many layers were compiled.

    Each distinct layer structure (a hybrid's layers differ in their FA / GDN head counts) is one more variant of
    the same code object for torch.compile, and training, evaluation and other lengths add variants of each: past
    dynamo's recompile limit (8 by default) the remaining variants run eagerly, slowly and without a word. The limit
    is raised to 16 per structure (``recompile_limit_for``)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode={mode!r}: give one of {', '.join(COMPILE_MODES)}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"compile: {type(model).__name__} has no .model.layers (a transformers decoder or a "
                        "hybrid); set compile = false")
    raise_recompile_limit(recompile_limit_for(layers))
    for layer in layers:
        layer.compile(mode=mode)
        layer._compile_mode = mode  # copy_model compiles a copy the same way
    return len(layers)


def recompile_limit_for(layers) -> int:
    """16 compiled variants per distinct layer structure (parameter names and shapes)."""
    structures = {tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()) for layer in layers}
    return 16 * len(structures)


def raise_recompile_limit(n: int) -> int:
    """dynamo's recompile limit raised to at least ``n`` (never lowered); returns the limit now in force."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, name) < n:
        setattr(cfg, name, n)
    return getattr(cfg, name)


def compiled_submodules(model: nn.Module) -> list[str]:
    """The names of ``model``'s submodules that run ``nn.Module.compile``'d ("" for the model itself)."""
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` that keeps ``nn.Module.compile``: ``Module.__getstate__`` drops a compiled
    module's ``_compiled_call_impl``, so a plain deepcopy of a compiled model runs eagerly (an earlier
    "compiled" throughput was such a copy: its kernel profile equalled the eager one's). The submodules that
    were compiled are compiled again on the copy, in the mode ``compile_decoder_layers`` gave them (else the
    default)."""
    import copy

    twin = copy.deepcopy(model)
    for name in compiled_submodules(model):
        sub = twin.get_submodule(name)
        sub.compile(mode=getattr(sub, "_compile_mode", "default"))  # the attribute survives the deepcopy
    return twin


def build_pretrain_model(mcfg, tokenizer, device: torch.device) -> nn.Module:
    """A fresh Qwen3-architecture model of ``mcfg`` (hybrid.train.ModelConfig), or the folder ``init_from``."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if mcfg.init_from:
        folder = Path(mcfg.init_from)
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"model.init_from={mcfg.init_from!r}: no config.json there; give a saved model "
                                    "folder (e.g. headscope/weights/default)")
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                                     attn_implementation="sdpa")
        if model.config.vocab_size != len(tokenizer):
            raise ValueError(f"model.init_from={mcfg.init_from!r}: vocab {model.config.vocab_size} != the "
                             f"tokenizer's {len(tokenizer)}; give the tokenizer the model was trained with")
        return model.to(device).train()
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=mcfg.hidden_size,
                      num_hidden_layers=mcfg.num_hidden_layers, num_attention_heads=mcfg.num_attention_heads,
                      num_key_value_heads=mcfg.num_key_value_heads, head_dim=mcfg.head_dim,
                      intermediate_size=mcfg.intermediate_size, max_position_embeddings=mcfg.max_position_embeddings,
                      rope_parameters={"rope_type": "default", "rope_theta": mcfg.rope_theta},
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, use_cache=True)
    return Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).to(device).train()


def identity(config, teacher: nn.Module | None, mask, tokenizer) -> dict[str, Any]:
    """What a checkpoint folder must match to belong to this run (a hybrid's also carries the teacher's legacy
    fingerprint, which ``check_run_folder`` accepts in place of its current one)."""
    from headscope.mask import config_fingerprint, legacy_config_fingerprint

    if config.is_hybrid:
        from hybrid.config import HybridOptions

        # "teacher_legacy": the fingerprint run folders started before RoPE settings were hashed recorded for this
        # teacher; check_run_folder accepts it, and run.json leaves it out (hybrid.train.checkpoint.LEGACY_TEACHER)
        return {"kind": "hybrid", "teacher": config_fingerprint(teacher),
                "teacher_legacy": legacy_config_fingerprint(teacher),
                "mask": {"fa_heads": [h.to_list() for h in mask.fa_heads], "fingerprint": mask.fingerprint},
                "hybrid": HybridOptions.from_dict(config.hybrid).to_dict(),
                "stages": [s.name for s in config.stages]}
    return {"kind": "pretrain", "model": dataclasses.asdict(config.model), "vocab": len(tokenizer),
            "stages": [s.name for s in config.stages]}


def save_final(model: nn.Module, tokenizer, folder: Path, state_dict: dict | None = None) -> Path:
    """save_pretrained (safetensors) + tokenizer into a temporary folder renamed to ``folder``."""
    folder = Path(folder)
    tmp = folder.parent / f".tmp-{folder.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.config.use_cache = True
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder
