"""Checking a saved hybrid folder before anything loads it: a missing or unreadable ``config.json``, a missing
``model.safetensors`` / index / shard, an unreadable index or a truncated shard is named with the fix, instead of a
stack trace from deep inside ``transformers``.

``check_folder`` is run by every loader of a saved hybrid (``hybrid.load``, ``HybridForCausalLM.from_pretrained``,
the Auto classes, and ``headscope.load_model`` through the loader ``hybrid`` registers in
``headscope.loaders.MODEL_LOADERS``).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["HybridFolderError", "check_folder", "weight_files", "TOKENIZER_FILES", "MODEL_TYPE"]

MODEL_TYPE = "headscope_hybrid"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_RESAVE = "save the model again (model.save_pretrained(path) or hybrid.save(model, path)) or copy the folder again"


class HybridFolderError(OSError):
    """A saved hybrid folder that cannot be loaded: the message names the file and the fix."""


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HybridFolderError(f"{path} is not valid JSON ({err.msg if hasattr(err, 'msg') else err}): the {what} "
                                f"is truncated or damaged; {_RESAVE}") from None
    if not isinstance(data, dict):
        raise HybridFolderError(f"{path}: the {what} should be a JSON object, got {type(data).__name__}; {_RESAVE}")
    return data


def _check_safetensors(path: Path) -> None:
    """A safetensors file is 8 bytes (header length N), N bytes of JSON header, then the tensor data, whose
    size the header states: a shorter file is truncated."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"its header claims {n} bytes but the file has {size - 8} after the length")
            header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as err:
        raise HybridFolderError(f"{path} is not a readable safetensors file ({err}): truncated or damaged; "
                                f"{_RESAVE}") from None
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if size < 8 + n + end:
        raise HybridFolderError(f"{path} is truncated: {size} bytes on disk, its header needs {8 + n + end}; "
                                f"{_RESAVE}")


def check_folder(path: str | Path, *, need_tokenizer: bool = False, need_hybrid: bool = True) -> Path:
    """Raise HybridFolderError naming the file and the fix unless ``path`` holds a loadable saved hybrid.

    Checks config.json (present, valid JSON, model_type ``headscope_hybrid`` when ``need_hybrid``), the weights
    (``model.safetensors``, or ``model.safetensors.index.json`` and every shard it lists, none truncated) and,
    with ``need_tokenizer``, that a tokenizer was saved alongside."""
    path = Path(path).expanduser()
    if not path.exists():
        raise HybridFolderError(f"{path} does not exist: pass the folder that model.save_pretrained wrote")
    if not path.is_dir():
        raise HybridFolderError(f"{path} is a file, not a folder: pass the folder that model.save_pretrained wrote")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise HybridFolderError(f"{path} has no config.json: not a saved model folder (or an incomplete copy); "
                                f"{_RESAVE}")
    cfg = _read_json(cfg_path, "model config")
    if need_hybrid and cfg.get("model_type") != MODEL_TYPE:
        raise HybridFolderError(
            f"{cfg_path} says model_type={cfg.get('model_type')!r}, not {MODEL_TYPE!r}: this is not a saved hybrid; "
            "load it with transformers.AutoModelForCausalLM or headscope.load_model")
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, "weights index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HybridFolderError(f"{index} has no weight_map: the index is damaged; {_RESAVE}")
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise HybridFolderError(f"{path / shard} is missing (listed in {index.name}): copy that shard into "
                                        f"the folder, or {_RESAVE}")
            _check_safetensors(path / shard)
    elif single.is_file():
        _check_safetensors(single)
    else:
        shards = sorted(p.name for p in path.glob("model-*.safetensors"))
        what = (f"shards {shards[:3]} but no model.safetensors.index.json (it maps tensors to shards)" if shards
                else "no model.safetensors (or model.safetensors.index.json and its shards)")
        raise HybridFolderError(f"{path} has {what}; {_RESAVE}")
    if need_tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise HybridFolderError(
            f"{path} holds no tokenizer (none of {list(TOKENIZER_FILES)}): save it with the model, "
            "model.save_pretrained(path, tokenizer=tok) or hybrid.save(model, path, tokenizer=tok), or load the "
            "model alone (hybrid.load(path)) and the teacher's tokenizer yourself")
    return path


def weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, for a folder ``check_folder`` accepted (its index, else
    the header of model.safetensors)."""
    path = Path(path).expanduser()
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: path / shard for name, shard in _read_json(index, "weights index")["weight_map"].items()}
    single = path / "model.safetensors"
    with single.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {name: single for name in header if name != "__metadata__"}
