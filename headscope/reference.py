"""The project's own small reference model (Qwen3 architecture, real retrieval heads), loaded offline.

    model, tokenizer = load_model()                    # headscope/weights/default
    model, tokenizer = load_model("/path/to/hf/folder")
    model, tokenizer = load_model("Qwen/Qwen3-0.6B")   # only if already in the local HF cache
    model, tokenizer = load_model("smollm2-135m")      # a named offline model: headscope/zoo.py

Nothing is ever downloaded (``local_files_only=True``). The shipped folder is a plain Hugging Face
folder: ``AutoModelForCausalLM.from_pretrained(default_path())`` works too.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from headscope.tokenizers import TOKENIZER_FILES  # the files one of which makes a tokenizer

__all__ = ["load_model", "load_tokenizer", "default_path", "has_default_weights", "check_device",
           "check_tokenizer_files", "ReferenceModelMissing", "MissingTokenizerError", "TOKENIZER_FILES", "DEFAULT_NAME"]

DEFAULT_NAME = "default"
_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
_TRAIN_HINT = ("train it with `python research/reference/train_reference.py --out runs/reference` on a GPU "
               "(see docs/reference_model.md) and copy the output folder to headscope/weights/default")


class ReferenceModelMissing(FileNotFoundError):
    """The shipped reference weights (or the requested local model) are not on disk."""


class MissingTokenizerError(FileNotFoundError):
    """A local model folder holds no tokenizer files (transformers would silently build an empty one)."""


def default_path() -> Path:
    return _WEIGHTS_DIR / DEFAULT_NAME


def _has_weights(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").exists() and (
        any(path.glob("*.safetensors")) or any(path.glob("*.bin")))


def has_default_weights() -> bool:
    """True when headscope/weights/default holds a model (config + safetensors)."""
    return _has_weights(default_path())


def _looks_like_path(text: str) -> bool:
    """A string meant as a local folder, not a hub name ('org/name' has at most one slash and no leading . / ~)."""
    return (os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") > 1 or "\\" in text
            or text.endswith("/"))


def _resolve(name_or_path: str | Path) -> str:
    from headscope import zoo

    if str(name_or_path) in zoo.MODELS:
        return str(zoo.ensure_local(str(name_or_path)))
    if str(name_or_path) == DEFAULT_NAME:
        path = default_path()
        if not _has_weights(path):
            raise ReferenceModelMissing(f"the default reference model is not in {path}: {_TRAIN_HINT}")
        return str(path)
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ReferenceModelMissing(f"{path} is a file; give the model's folder (config.json + *.safetensors)")
        if not _has_weights(path):
            raise ReferenceModelMissing(f"{path} holds no Hugging Face model (config.json + *.safetensors)")
        return str(path)
    if isinstance(name_or_path, Path) or _looks_like_path(str(name_or_path)):
        raise ReferenceModelMissing(f"the model folder {path} does not exist; check the path")
    if "/" not in str(name_or_path):  # neither a folder nor an "org/name" hub id
        raise zoo.UnknownModelError(f"unknown model {str(name_or_path)!r}: not a folder; known models: "
                                    f"{', '.join(zoo.known_models())} (or a local Hugging Face folder)")
    return str(name_or_path)  # a hub name: must already be in the local cache


def check_device(device: "str | torch.device") -> torch.device:
    """``device`` as a torch.device; refuse a CUDA device on a machine without CUDA (or an index it lacks)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available on this machine (torch "
                             f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use device='cpu' "
                             "(--device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r} but this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return dev


def check_tokenizer_files(path: str | Path) -> None:
    """Refuse a local folder without tokenizer files: transformers would silently build a one-token tokenizer
    from the config's model type, and every prompt would encode to nothing."""
    folder = Path(path)
    if folder.is_dir() and not any((folder / f).exists() for f in TOKENIZER_FILES):
        raise MissingTokenizerError(
            f"{folder} holds no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there. Save the model's "
            f"tokenizer into it (tokenizer.save_pretrained({str(folder)!r})) or pass tokenizer=... explicitly")


def load_tokenizer(name_or_path: str | Path = DEFAULT_NAME):
    """The tokenizer of a model folder ("default", a local folder or a cached hub name), offline; refused
    (MissingTokenizerError naming the files looked for) when a local folder has none."""
    from transformers import AutoTokenizer

    src = _resolve(name_or_path)
    check_tokenizer_files(src)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
    except OSError as err:
        raise ReferenceModelMissing(_not_loadable(name_or_path, err)) from err
    if len(tokenizer) <= 1:  # what transformers builds from a config alone
        raise MissingTokenizerError(f"the tokenizer loaded from {src} has {len(tokenizer)} token(s): its files are "
                                    f"missing or empty (looked for {', '.join(TOKENIZER_FILES)})")
    from headscope.tokenizers import prepare_tokenizer

    return prepare_tokenizer(tokenizer)


def _not_loadable(name_or_path, err: BaseException) -> str:
    if str(name_or_path) == DEFAULT_NAME:
        return f"cannot load the default model ({err}). {_TRAIN_HINT}"
    return (f"cannot load {str(name_or_path)!r} offline: it is not a local folder and not in the local Hugging "
            f"Face cache (headscope never downloads; pass a local folder). ({str(err).splitlines()[0]})")


def load_model(name_or_path: str | Path = DEFAULT_NAME, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", attn_implementation: str = "sdpa"):
    """Load ``(model, tokenizer)`` offline, in eval mode, on ``device``.

    Refused with a clear message: a CUDA device without CUDA, a folder that does not exist, a folder
    without weights or without tokenizer files, a hub name that is not in the local cache."""
    from transformers import AutoModelForCausalLM

    dev = check_device(device)
    from headscope import zoo
    from headscope.loaders import prepare_folder

    if str(name_or_path) != DEFAULT_NAME and str(name_or_path) not in zoo.MODELS:
        # a folder of a model type transformers does not know (a saved hybrid): its package's loader registers the
        # classes and names a broken file up front (headscope.loaders)
        prepare_folder(name_or_path, need_tokenizer=True)
    src = _resolve(name_or_path)
    tokenizer = load_tokenizer(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, attn_implementation=attn_implementation,
                                                     local_files_only=True)
    except OSError as err:
        raise ReferenceModelMissing(_not_loadable(name_or_path, err)) from err
    from headscope.tokenizers import remember_tokenizer

    model = model.to(dev).eval()
    remember_tokenizer(model, tokenizer)  # score(model, task) finds it
    if str(name_or_path) in zoo.MODELS:
        zoo.remember(model, str(name_or_path))  # score(model, task) applies its task defaults
    return model, tokenizer
