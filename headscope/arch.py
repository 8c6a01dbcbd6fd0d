"""Where the attention heads live in a Hugging Face causal LM.

``describe(model)`` returns an ``Arch``: the decoder layers, each layer's attention module and its
output projection (whose *input* is the concatenation of the per-head outputs, ``z  # [B, T, H*D]``),
and the head counts. Everything that patches or ablates heads goes through this one table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from headscope.registry import Registry

__all__ = ["Arch", "describe", "UnsupportedModelError", "SUPPORTED_FAMILIES"]


class UnsupportedModelError(TypeError):
    """The model's architecture is not one whose heads headscope knows how to address."""


# family -> (path of the decoder-layer list, attention attribute, output-projection attribute); a new layout is one
# LAYOUTS.register(name, (...)) and a test
LAYOUTS: Registry[tuple[str, str, str]] = Registry("architecture layout")
LAYOUTS.register("llama", ("model.layers", "self_attn", "o_proj"))  # Llama, Qwen2, Qwen3, Mistral, Gemma, Phi3, ...
LAYOUTS.register("gpt2", ("transformer.h", "attn", "c_proj"))
LAYOUTS.register("gpt_neox", ("gpt_neox.layers", "attention", "dense"))
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "gpt_neox")


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclass(frozen=True)
class Arch:
    """The head layout of one model."""

    layout: str
    layers: tuple[nn.Module, ...]
    attentions: tuple[nn.Module, ...]
    out_projs: tuple[nn.Module, ...]  # input z  # [B, T, H*D]
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    layers_path: str

    @property
    def n_total(self) -> int:
        return self.n_layers * self.n_heads

    def head_slice(self, head: int) -> slice:
        """Channels of head ``head`` in the output projection's input."""
        return slice(head * self.head_dim, (head + 1) * self.head_dim)


def describe(model: nn.Module) -> Arch:
    """Find the decoder layers, attention modules and output projections of ``model``."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no .config; headscope works on Hugging Face causal LMs "
            "(or a TransformerBridge / nnsight model wrapping one)")
    for layout, (layers_path, attn_name, proj_name) in LAYOUTS.items():
        layers = _get(model, layers_path)
        if layers is None or len(layers) == 0:
            continue
        attns = [getattr(layer, attn_name, None) for layer in layers]
        projs = [getattr(a, proj_name, None) if a is not None else None for a in attns]
        if any(a is None for a in attns) or any(p is None for p in projs):
            continue
        n_heads = int(getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head"))
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        hidden = int(getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd"))
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // n_heads)
        in_features = getattr(projs[0], "in_features", None) or getattr(projs[0], "nx", None)
        if in_features is not None and in_features != n_heads * head_dim:
            raise UnsupportedModelError(
                f"{type(model).__name__}: output projection takes {in_features} channels, expected "
                f"n_heads*head_dim = {n_heads}*{head_dim}")
        return Arch(layout=layout, layers=tuple(layers), attentions=tuple(attns), out_projs=tuple(projs),
                    n_layers=len(layers), n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
                    layers_path=layers_path)
    raise UnsupportedModelError(
        f"headscope does not know where the attention heads of {type(model).__name__} "
        f"(model_type={getattr(cfg, 'model_type', '?')!r}) live; supported families: {', '.join(SUPPORTED_FAMILIES)}. "
        "Models laid out like Llama (model.layers[i].self_attn.o_proj) work whatever their name.")
