"""Saving and loading hybrids the way people save and load models, with clear errors for broken folders.

    hybrid.save(model, "out/hybrid", tokenizer=tok)        # = model.save_pretrained("out/hybrid", tokenizer=tok)
    model = hybrid.load("out/hybrid")                       # the model only
    model, tok = hybrid.load("out/hybrid", with_tokenizer=True)
    model, tok = headscope.load_model("out/hybrid")         # the same, through headscope
    model = AutoModelForCausalLM.from_pretrained("out/hybrid")   # after `import hybrid` (it registers the classes)

``check_folder(path)`` (``hybrid.folders``) is run by every one of these loaders first: a missing or unreadable
``config.json``, a missing ``model.safetensors`` / index / shard, an unreadable index or a truncated shard is named
with the fix, instead of a stack trace from deep inside ``transformers``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hybrid.folders import TOKENIZER_FILES, HybridFolderError, check_folder
from hybrid.modeling import HybridForCausalLM

__all__ = ["HybridFolderError", "check_folder", "save", "load", "TOKENIZER_FILES"]


def save(model: Any, path: str | Path, tokenizer: Any = None, **kwargs: Any) -> Path:
    """``model.save_pretrained(path, tokenizer=tokenizer, **kwargs)``; returns the folder. A path that is an
    existing file is refused (``FileExistsError``)."""
    from hybrid.modeling import refuse_file_path

    refuse_file_path(path)
    model.save_pretrained(path, tokenizer=tokenizer, **kwargs)
    return Path(path)


def load(path: str | Path, *, with_tokenizer: bool = False, **kwargs: Any):
    """The saved hybrid at ``path`` (eval mode); ``(model, tokenizer)`` with ``with_tokenizer=True``.

    ``kwargs`` go to ``HybridForCausalLM.from_pretrained`` (e.g. ``dtype=torch.bfloat16``, ``device_map``)."""
    check_folder(path, need_tokenizer=with_tokenizer)
    model = HybridForCausalLM.from_pretrained(path, **kwargs).eval()
    if not with_tokenizer:
        return model
    from transformers import AutoTokenizer

    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)
