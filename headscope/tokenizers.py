"""A model's tokenizer, found without being told.

    model, tok = headscope.load_model("default")
    find_tokenizer(model) is tok                       # remembered by load_model
    model = AutoModelForCausalLM.from_pretrained("/path/to/folder")
    find_tokenizer(model)                              # loaded from that folder, offline, then cached

``find_tokenizer(model, tokenizer=None)`` returns, in this order: ``tokenizer`` when given (an explicit
tokenizer always wins); the tokenizer the model carries (an nnsight ``LanguageModel``); the one
``headscope.load_model`` loaded with it; one loaded offline (``local_files_only=True``) from the folder the
model was loaded from (its ``name_or_path`` / ``config._name_or_path``). A loaded tokenizer is cached per model
object. If none is found, the error says what to pass.

A TransformerLens ``TransformerBridge`` is scored as its plain model: with the tokenizer given to
``bridge_from_hf``, else the plain model's own (remembered or saved beside it), not TransformerLens's
``bridge.tokenizer``, which prepends BOS where the model's tokenizer may not (that would change every prompt and
every score). Only when no other is found is ``bridge.tokenizer`` used, with a warning if it prepends BOS.
"""
from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

__all__ = ["find_tokenizer", "remember_tokenizer", "unwrap", "prepare_tokenizer", "TokenizerNotFound",
           "TOKENIZER_FILES", "bos_id"]

# Files one of which a folder holds when it holds a tokenizer (fast, sentencepiece, BPE / WordPiece vocab).
# tokenizer_config.json alone is not one: from it (or from config.json alone) transformers silently builds a
# tokenizer with one token.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")

_CACHE: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


_BOS_CACHE: "weakref.WeakKeyDictionary[Any, int | None]" = weakref.WeakKeyDictionary()


def bos_id(tokenizer) -> int | None:
    """The BOS id the tokenizer prepends by default, or None if it adds nothing at the start."""
    try:
        return _BOS_CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    with_special = tokenizer("x y").input_ids
    plain = tokenizer("x y", add_special_tokens=False).input_ids
    bos = None
    if len(with_special) > len(plain) and with_special[1: 1 + len(plain)] == plain:
        bos = with_special[0]
    try:
        _BOS_CACHE[tokenizer] = bos
    except TypeError:
        pass
    return bos


class TokenizerNotFound(ValueError):
    """No tokenizer was passed and none could be found for the model."""


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Give a tokenizer without a pad token its EOS token as pad (padding batches needs one)."""
    if getattr(tokenizer, "pad_token_id", None) is None and getattr(tokenizer, "eos_token_id", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def unwrap(model: Any) -> Any:
    """The torch model inside a TransformerBridge / nnsight wrapper, or the object itself."""
    from headscope.patching.nn_sight import is_nnsight_model, unwrap_nnsight
    from headscope.patching.tl import is_transformer_bridge

    if is_transformer_bridge(model):
        return model.original_model
    if is_nnsight_model(model):
        try:
            return unwrap_nnsight(model)
        except TypeError:
            return model
    return model


def remember_tokenizer(model: Any, tokenizer: Any) -> None:
    """Record ``tokenizer`` as ``model``'s, so that ``find_tokenizer(model)`` returns it (weakly held)."""
    _CACHE[unwrap(model)] = tokenizer


def _source(model: Any) -> str:
    for obj in (model, getattr(model, "config", None)):
        for key in ("name_or_path", "_name_or_path"):
            value = getattr(obj, key, None)
            if isinstance(value, (str, Path)) and str(value):
                return str(value)
    return ""


def _load_from(source: str) -> Any:
    from transformers import AutoTokenizer

    path = Path(source).expanduser()
    if path.is_dir() and not any((path / f).exists() for f in TOKENIZER_FILES):
        raise TokenizerNotFound(f"the model was loaded from {path}, which holds no tokenizer (none of "
                                f"{', '.join(TOKENIZER_FILES)}); pass tokenizer=AutoTokenizer.from_pretrained(<the "
                                "folder that holds it>), or save it next to the model: tokenizer.save_pretrained"
                                f"({str(path)!r})")
    try:
        tok = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else source, local_files_only=True)
    except (OSError, ValueError) as err:
        raise TokenizerNotFound(f"cannot load the tokenizer of {source!r} offline ({err}); pass tokenizer=... "
                                "(headscope never downloads)") from err
    if len(tok) <= 1:  # built from a config alone
        raise TokenizerNotFound(f"the tokenizer loaded from {source} has {len(tok)} token(s): its files are missing "
                                f"(looked for {', '.join(TOKENIZER_FILES)}); pass tokenizer=...")
    return prepare_tokenizer(tok)


def find_tokenizer(model: Any, tokenizer: Any = None, *, required: bool = True) -> Any:
    """The tokenizer to use with ``model`` (see the module docstring); None only when not ``required``."""
    if tokenizer is not None:
        return tokenizer
    from headscope.patching.tl import is_transformer_bridge

    if is_transformer_bridge(model):
        return _bridge_tokenizer(model, required)
    carried = getattr(model, "tokenizer", None)
    if carried is not None:
        return carried
    return _plain_tokenizer(model, required)


def _plain_tokenizer(model: Any, required: bool) -> Any:
    """The tokenizer remembered for (or saved beside) the model inside ``model``."""
    inner = unwrap(model)
    try:
        if inner in _CACHE:
            return _CACHE[inner]
    except TypeError:  # not weak-referenceable: nothing cached for it
        pass
    source = _source(inner)
    if source:
        try:
            found = _load_from(source)
        except TokenizerNotFound:
            if required:
                raise
            return None
        try:
            _CACHE[inner] = found
        except TypeError:
            pass
        return found
    if not required:
        return None
    raise TokenizerNotFound(
        f"no tokenizer for this {type(model).__name__}: it was not loaded by headscope.load_model and names no "
        "folder it came from (config._name_or_path is empty). Pass tokenizer=<its tokenizer>, e.g. "
        "`model, tok = headscope.load_model(path)` then tokenizer=tok, or "
        "tokenizer=AutoTokenizer.from_pretrained(<model folder>)")


def _bridge_tokenizer(bridge: Any, required: bool) -> Any:
    """A TransformerBridge is scored as its plain model: with the HF tokenizer given to ``bridge_from_hf``, else
    the plain model's own (remembered, or saved beside it). TransformerLens's ``bridge.tokenizer`` prepends BOS
    where the model's tokenizer may not, which changes every prompt and so every score: it is used only when no
    other is found, with a warning when it does prepend one."""
    import warnings

    from headscope.patching.tl import _TOKENIZER_ATTR

    given = getattr(bridge, _TOKENIZER_ATTR, None)
    if given is not None:
        return given
    try:
        plain = _plain_tokenizer(bridge, required=False)
    except TokenizerNotFound:
        plain = None
    if plain is not None:
        return plain
    carried = getattr(bridge, "tokenizer", None)
    if carried is None:
        return _plain_tokenizer(bridge, required)  # raises the usual "pass tokenizer=..." when required
    bos = bos_id(carried)
    if bos is not None:
        warnings.warn(
            f"this TransformerBridge's tokenizer (TransformerLens's) prepends BOS (id {bos}) to every prompt, and "
            "the plain model's own tokenizer was not found to check whether it does too: the scores can differ "
            "from the plain model's. Pass tokenizer=<the model's tokenizer> (or build the bridge with "
            "headscope.patching.tl.bridge_from_hf(model, tokenizer)) to score it exactly as the plain model",
            UserWarning, stacklevel=3)
    return carried
