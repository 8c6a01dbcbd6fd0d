"""The head mask: which query heads keep full attention (FA); the rest become linear attention.

The JSON file is the hand-off between ``headscope`` (which selects heads) and ``hybrid``
(which builds the model). It carries a schema version, the model's shape and a fingerprint
of its config, the heads kept, and the scores and settings that produced them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from headscope.heads import Head

__all__ = ["HeadMask", "MaskError", "SCHEMA_VERSION", "config_fingerprint", "model_shape"]

SCHEMA_VERSION = 1


class MaskError(ValueError):
    """A head mask that is malformed or does not fit the model it is used with."""


_SHAPE_KEYS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim")
_ALIASES = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads"),
    "num_key_value_heads": ("num_key_value_heads", "n_kv_heads"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "head_dim": ("head_dim",),
}


def _config_of(model_or_config: Any) -> Any:
    return getattr(model_or_config, "config", model_or_config)


def model_shape(model_or_config: Any) -> dict[str, int]:
    """The attention shape of a model or config: layers, query heads, KV heads, hidden, head dim."""
    cfg = _config_of(model_or_config)
    get = (lambda k: cfg.get(k)) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
    shape: dict[str, int] = {}
    for key in _SHAPE_KEYS:
        for alias in _ALIASES[key]:
            value = get(alias)
            if value is not None:
                shape[key] = int(value)
                break
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if key not in shape:
            raise MaskError(f"cannot read {key!r} from the model config {type(cfg).__name__}")
    shape.setdefault("num_key_value_heads", shape["num_attention_heads"])
    shape.setdefault("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    return shape


def config_fingerprint(model_or_config: Any) -> str:
    """A short hash of the config's architecture fields (not of the weights)."""
    cfg = _config_of(model_or_config)
    data = cfg if isinstance(cfg, dict) else cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg)
    keep = {k: data[k] for k in sorted(data) if k in {
        "model_type", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "hidden_size", "intermediate_size", "head_dim", "max_position_embeddings", "n_layer", "n_head",
        "n_embd", "rope_theta"}}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class HeadMask:
    """Query heads kept as full attention, for a model of ``n_layers`` x ``n_heads`` heads."""

    n_layers: int
    n_heads: int
    fa_heads: tuple[Head, ...]
    n_kv_heads: int | None = None
    model_type: str | None = None
    fingerprint: str | None = None
    scores: tuple[tuple[float, ...], ...] | None = None  # [L][H] the scores the selection used
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise MaskError(f"HeadMask.{name} must be a positive int, got {value!r}")
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise MaskError(f"HeadMask.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        heads = tuple(Head.from_any(h) for h in self.fa_heads)
        seen: set[Head] = set()
        for h in heads:
            if h in seen:
                raise MaskError(f"HeadMask.fa_heads lists {h} twice; each head may appear once")
            seen.add(h)
            if h.layer >= self.n_layers or h.head >= self.n_heads:
                raise MaskError(
                    f"HeadMask.fa_heads has {h}, outside a model of {self.n_layers} layers x {self.n_heads} heads")
        object.__setattr__(self, "fa_heads", tuple(sorted(heads)))
        if self.scores is not None:
            rows = tuple(tuple(float(x) for x in row) for row in self.scores)
            if len(rows) != self.n_layers or any(len(r) != self.n_heads for r in rows):
                raise MaskError(f"HeadMask.scores must be {self.n_layers} x {self.n_heads}")
            object.__setattr__(self, "scores", rows)

    # ---- queries -------------------------------------------------------------------------
    @property
    def n_total(self) -> int:
        return self.n_layers * self.n_heads

    def __len__(self) -> int:
        return len(self.fa_heads)

    def __contains__(self, head: object) -> bool:
        return Head.from_any(head) in set(self.fa_heads)  # type: ignore[arg-type]

    def is_fa(self, layer: int, head: int) -> bool:
        return Head(layer, head) in self

    def fa_in_layer(self, layer: int) -> tuple[int, ...]:
        """Sorted query-head indices kept as full attention in ``layer``."""
        return tuple(h.head for h in self.fa_heads if h.layer == layer)

    def la_in_layer(self, layer: int) -> tuple[int, ...]:
        fa = set(self.fa_in_layer(layer))
        return tuple(h for h in range(self.n_heads) if h not in fa)

    def per_layer_counts(self) -> list[int]:
        return [len(self.fa_in_layer(l)) for l in range(self.n_layers)]

    @property
    def ratio(self) -> str:
        """LA:FA ratio, e.g. '7:1' (rounded to one decimal when not whole)."""
        fa = len(self)
        if fa == 0:
            return "inf:0"
        r = (self.n_total - fa) / fa
        return f"{r:g}:1" if r == int(r) else f"{r:.1f}:1"

    def to_tensor(self):
        """Boolean [L, H] tensor, True where the head keeps full attention."""
        import torch

        out = torch.zeros(self.n_layers, self.n_heads, dtype=torch.bool)  # [L, H]
        for h in self.fa_heads:
            out[h.layer, h.head] = True
        return out

    # ---- validation ----------------------------------------------------------------------
    def validate_for(self, model_or_config: Any, *, require_fa_per_layer: bool = False,
                     check_fingerprint: bool = True) -> None:
        """Raise MaskError unless this mask fits the model (shape, and fingerprint when recorded)."""
        shape = model_shape(model_or_config)
        if (shape["num_hidden_layers"], shape["num_attention_heads"]) != (self.n_layers, self.n_heads):
            raise MaskError(
                f"mask is for {self.n_layers} layers x {self.n_heads} heads, but the model has "
                f"{shape['num_hidden_layers']} x {shape['num_attention_heads']}: select heads on this model")
        if self.n_kv_heads is not None and shape["num_key_value_heads"] != self.n_kv_heads:
            raise MaskError(f"mask is for n_kv_heads={self.n_kv_heads}, the model has {shape['num_key_value_heads']}")
        if check_fingerprint and self.fingerprint is not None:
            fp = config_fingerprint(model_or_config)
            if fp != self.fingerprint:
                raise MaskError(
                    f"mask config fingerprint {self.fingerprint} != model's {fp}: the mask was made for another "
                    "model; pass check_fingerprint=False to use it anyway")
        if require_fa_per_layer:
            empty = [l for l in range(self.n_layers) if not self.fa_in_layer(l)]
            if empty:
                raise MaskError(f"layers {empty} have no full-attention head, and this use requires one per layer")

    # ---- construction and JSON -----------------------------------------------------------
    @classmethod
    def for_model(cls, model_or_config: Any, fa_heads: Iterable[Any], **kw: Any) -> "HeadMask":
        shape = model_shape(model_or_config)
        cfg = _config_of(model_or_config)
        return cls(n_layers=shape["num_hidden_layers"], n_heads=shape["num_attention_heads"],
                   n_kv_heads=shape["num_key_value_heads"], fa_heads=tuple(fa_heads),
                   model_type=getattr(cfg, "model_type", None), fingerprint=config_fingerprint(cfg), **kw)

    def to_dict(self) -> dict[str, Any]:
        from headscope import __version__

        return {
            "schema": "headscope.head_mask",
            "schema_version": SCHEMA_VERSION,
            "headscope_version": __version__,
            "model": {"n_layers": self.n_layers, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                      "model_type": self.model_type, "config_fingerprint": self.fingerprint},
            "fa_heads": [h.to_list() for h in self.fa_heads],
            "n_fa": len(self),
            "ratio_la_fa": self.ratio,
            "scores": [list(r) for r in self.scores] if self.scores is not None else None,
            "settings": self.settings,
        }

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, default=str)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HeadMask":
        if not isinstance(data, dict) or data.get("schema") != "headscope.head_mask":
            raise MaskError("not a headscope head-mask: the 'schema' field must be 'headscope.head_mask'")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise MaskError(f"head-mask schema_version {version!r} is not supported (this headscope reads "
                            f"{SCHEMA_VERSION}); re-export the mask with this version")
        try:
            model = data["model"]
            return cls(n_layers=model["n_layers"], n_heads=model["n_heads"], n_kv_heads=model.get("n_kv_heads"),
                       model_type=model.get("model_type"), fingerprint=model.get("config_fingerprint"),
                       fa_heads=tuple(Head.from_any(h) for h in data["fa_heads"]),
                       scores=data.get("scores"), settings=data.get("settings") or {})
        except KeyError as exc:
            raise MaskError(f"head-mask JSON is missing the field {exc.args[0]!r}") from None

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> "HeadMask":
        p = Path(path_or_text) if not str(path_or_text).lstrip().startswith("{") else None
        if p is not None and not p.exists():
            raise MaskError(f"head-mask file {p} does not exist")
        text = p.read_text() if p is not None else str(path_or_text)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MaskError(f"head-mask file is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    load = from_json
