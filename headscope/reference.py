"""The project's own small reference model (Qwen3 architecture, real retrieval heads), loaded offline.

    model, tokenizer = load_model()                    # headscope/weights/default
    model, tokenizer = load_model("/path/to/hf/folder")
    model, tokenizer = load_model("Qwen/Qwen3-0.6B")   # only if already in the local HF cache

Nothing is ever downloaded (``local_files_only=True``). The shipped folder is a plain Hugging Face
folder: ``AutoModelForCausalLM.from_pretrained(default_path())`` works too.
"""
from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["load_model", "default_path", "has_default_weights", "ReferenceModelMissing", "DEFAULT_NAME"]

DEFAULT_NAME = "default"
_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
_TRAIN_HINT = ("train it with `python experiments/reference/train_reference.py --out runs/reference` on a GPU "
               "(see docs/reference_model.md) and copy the output folder to headscope/weights/default")


class ReferenceModelMissing(FileNotFoundError):
    """The shipped reference weights (or the requested local model) are not on disk."""


def default_path() -> Path:
    return _WEIGHTS_DIR / DEFAULT_NAME


def _has_weights(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").exists() and (
        any(path.glob("*.safetensors")) or any(path.glob("*.bin")))


def has_default_weights() -> bool:
    """True when headscope/weights/default holds a model (config + safetensors)."""
    return _has_weights(default_path())


def _is_hybrid_folder(name_or_path: str | Path) -> bool:
    """A local folder whose config.json names the hybrid's model_type (read as text: a truncated file counts)."""
    cfg = Path(name_or_path).expanduser() / "config.json"
    return str(name_or_path) != DEFAULT_NAME and cfg.is_file() and '"headscope_hybrid"' in cfg.read_text(errors="replace")


def _resolve(name_or_path: str | Path) -> str:
    if str(name_or_path) == DEFAULT_NAME:
        path = default_path()
        if not _has_weights(path):
            raise ReferenceModelMissing(f"the default reference model is not in {path}: {_TRAIN_HINT}")
        return str(path)
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not _has_weights(path):
            raise ReferenceModelMissing(f"{path} holds no Hugging Face model (config.json + *.safetensors)")
        return str(path)
    return str(name_or_path)  # a hub name: must already be in the local cache


def load_model(name_or_path: str | Path = DEFAULT_NAME, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", attn_implementation: str = "sdpa"):
    """Load ``(model, tokenizer)`` offline, in eval mode, on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if _is_hybrid_folder(name_or_path):  # a saved hybrid: register its classes, name a broken file up front
        from hybrid.saving import check_folder

        check_folder(name_or_path, need_tokenizer=True)
    src = _resolve(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, attn_implementation=attn_implementation,
                                                     local_files_only=True)
    except OSError as err:
        raise ReferenceModelMissing(
            f"cannot load {name_or_path!r} offline ({err}); pass a local folder or a name already in the "
            f"Hugging Face cache (headscope never downloads). For the default model: {_TRAIN_HINT}") from err
    from headscope.tokenizers import prepare_tokenizer, remember_tokenizer

    model = model.to(device).eval()
    remember_tokenizer(model, prepare_tokenizer(tokenizer))  # score(model, task) finds it
    return model, tokenizer
