"""Baselines built by the same code as ``from_mask``: layer-wise hybrids (whole layers FA or GDN), the
token-level hybrid (sliding-window attention + Gated DeltaNet on every head of every layer) and the teacher.

- ``layerwise_mask(teacher, ratio="3:1")``: ``headscope.selection.layerwise`` (whole, evenly spaced FA layers,
  the last of each period: "3:1" on 28 layers keeps 3, 7, ..., 27).
- ``from_layers(teacher, fa_layers=[...])``: the layer-wise hybrid for an explicit list of FA layers.
- ``from_token_level(teacher, window=512)``: ``granularity="token"``, every layer a ``TokenHybridAttention``.
- ``from_teacher(teacher)``: every head FA with RoPE, no log scale, no gate, no merge norm: the teacher's
  function in this code base (its logits equal the teacher's), so all experiments share one model class; its mask
  and options are ``teacher_mask`` and ``TEACHER_OPTIONS`` (also the studies' "tuned_teacher" variant kind).
"""
from __future__ import annotations

from typing import Any, Sequence

from headscope.mask import HeadMask, model_shape
from hybrid.config import HybridConfigError
from hybrid.convert import from_mask
from hybrid.modeling import HybridForCausalLM

__all__ = ["layerwise_mask", "from_layers", "from_token_level", "from_teacher", "teacher_mask", "TEACHER_OPTIONS"]


def layerwise_mask(teacher: Any, ratio: str | float = "3:1") -> HeadMask:
    """A HeadMask with whole FA layers, evenly spaced, the last of each period FA (3:1 on 28 layers: 3, 7, .., 27).

    ``ratio`` is "LA:FA" (or a number, LA per FA), as everywhere in headscope: this is
    ``headscope.selection.layerwise``."""
    from headscope.selection import layerwise

    return layerwise(teacher, ratio)


def from_layers(teacher: Any, fa_layers: Sequence[int], **options: Any) -> HybridForCausalLM:
    """The layer-wise hybrid: layers in ``fa_layers`` keep all heads FA, the others are all GDN."""
    shape = model_shape(teacher)
    L, H = shape["num_hidden_layers"], shape["num_attention_heads"]
    bad = [l for l in fa_layers if not 0 <= l < L]
    if bad:
        raise HybridConfigError(f"fa_layers {bad} outside 0..{L - 1}")
    layers = sorted(set(fa_layers))
    mask = HeadMask.for_model(teacher, [(l, h) for l in layers for h in range(H)],
                              settings={"strategy": "layerwise", "layers": layers})
    options.setdefault("granularity", "layer")
    return from_mask(teacher, mask, **options)


def from_token_level(teacher: Any, window: int = 512, **options: Any) -> HybridForCausalLM:
    """The token-level hybrid: sliding-window attention (``window`` keys) + GDN on every head."""
    return from_mask(teacher, HeadMask.for_model(teacher, []), granularity="token", window=window, **options)


# the HybridOptions under which an every-head-FA mask computes the teacher's own function (and adds no parameter)
TEACHER_OPTIONS = {"fa_rope": True, "fa_log_scale": False, "fa_gate": "none", "merge": "none",
                   "allow_degenerate": True}


def teacher_mask(teacher: Any, settings: dict[str, Any] | None = None) -> HeadMask:
    """Every head of ``teacher`` FA (with ``TEACHER_OPTIONS``: the teacher itself)."""
    shape = model_shape(teacher)
    heads = [(l, h) for l in range(shape["num_hidden_layers"]) for h in range(shape["num_attention_heads"])]
    return HeadMask.for_model(teacher, heads, settings=dict(settings or {}))


def from_teacher(teacher: Any, **options: Any) -> HybridForCausalLM:
    """The teacher as a HybridForCausalLM: every head FA, RoPE kept, no log scale, no gate, no merge norm."""
    return from_mask(teacher, teacher_mask(teacher), **{**TEACHER_OPTIONS, **options})
