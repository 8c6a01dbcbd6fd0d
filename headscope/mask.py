"""The head mask: which query heads keep full attention (FA); the rest become linear attention.

The JSON file is the hand-off between ``headscope`` (which selects heads) and ``hybrid``
(which builds the model). It carries a schema version, the model's shape and a fingerprint
of its config, the heads kept, the key/value heads they keep and the resulting share of the
teacher's KV cache, and the scores and settings that produced them.

Schema versions: 2 (written now) adds ``fa_kv_heads`` (per layer, the KV heads the FA query heads
read), ``n_fa_kv`` and ``kv_cache_share``; 1 (no KV fields) is still read. The derived fields
(``n_fa``, ``ratio_la_fa`` and the KV fields) must agree with ``fa_heads``: a file whose fields
contradict it is refused rather than guessed at.

The config fingerprint hashes the architecture fields and the RoPE settings (``config_fingerprint``); a mask
written before RoPE settings were hashed carries the legacy fingerprint and is still accepted for its model
(``fingerprint_matches``).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from headscope.heads import Head
from headscope.io import write_text

__all__ = ["HeadMask", "MaskError", "SCHEMA_VERSION", "READABLE_VERSIONS", "config_fingerprint", "model_shape",
           "legacy_config_fingerprint", "fingerprint_matches", "rope_parameters"]

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)


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


_FINGERPRINT_FIELDS = frozenset({
    "model_type", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
    "intermediate_size", "head_dim", "max_position_embeddings", "n_layer", "n_head", "n_embd"})


def _config_dict(model_or_config: Any) -> dict[str, Any]:
    cfg = _config_of(model_or_config)
    return cfg if isinstance(cfg, dict) else cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg)


def _number(v: Any) -> Any:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def rope_parameters(model_or_config: Any) -> dict[str, Any] | None:
    """The config's RoPE settings in one form whatever the transformers version wrote: transformers 5's
    ``rope_parameters`` (per layer type when the model has several), or transformers 4's top-level
    ``rope_theta`` with its ``rope_scaling``; numbers as floats, ``rope_type`` "default" when unset. None for a
    model without RoPE settings (GPT-2)."""
    data = _config_dict(model_or_config)

    def norm(d: dict[str, Any]) -> dict[str, Any]:
        out = {k: _number(v) for k, v in d.items() if v is not None and k != "type"}
        out.setdefault("rope_type", d.get("type") or "default")
        return out

    params = data.get("rope_parameters")
    if isinstance(params, dict) and params:
        if all(isinstance(v, dict) for v in params.values()):  # per layer type (sliding / full attention)
            return {k: norm(v) for k, v in sorted(params.items())}
        return norm(params)
    theta, scaling = data.get("rope_theta"), data.get("rope_scaling")
    if theta is None and not isinstance(scaling, dict):
        return None
    merged = dict(scaling) if isinstance(scaling, dict) else {}
    if theta is not None:
        merged["rope_theta"] = theta
    for key in ("partial_rotary_factor",):
        if data.get(key) is not None:
            merged.setdefault(key, data[key])
    return norm(merged)


def _hash(keep: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_fingerprint(model_or_config: Any) -> str:
    """A short hash of the config's architecture fields and RoPE settings (not of the weights).

    The RoPE settings are read wherever the config keeps them (``rope_parameters`` under transformers 5,
    ``rope_theta`` / ``rope_scaling`` before), so two models that differ only in their RoPE base or scaling get
    different fingerprints. A model without RoPE settings keeps the fingerprint it had before RoPE was hashed."""
    data = _config_dict(model_or_config)
    keep = {k: data[k] for k in sorted(data) if k in _FINGERPRINT_FIELDS}
    rope = rope_parameters(data)
    if rope is not None:
        keep["rope"] = rope
    return _hash(keep)


def legacy_config_fingerprint(model_or_config: Any) -> str:
    """The fingerprint masks recorded before RoPE settings were hashed: the architecture fields and a top-level
    ``rope_theta`` (which transformers 5 configs no longer have, so it ignored their RoPE settings)."""
    data = _config_dict(model_or_config)
    return _hash({k: data[k] for k in sorted(data) if k in _FINGERPRINT_FIELDS | {"rope_theta"}})


def fingerprint_matches(model_or_config: Any, fingerprint: str) -> bool:
    """True when ``fingerprint`` (from a mask, scores or results file) is this model's config fingerprint, the
    current one or the legacy one (files written before RoPE settings were hashed still match)."""
    return fingerprint in (config_fingerprint(model_or_config), legacy_config_fingerprint(model_or_config))


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
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise MaskError(f"HeadMask.{name} must be a positive int, got {value!r}")
        kv = self.n_kv_heads
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or self.n_heads % kv):
            raise MaskError(f"HeadMask.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if isinstance(self.fa_heads, (str, bytes)) or not hasattr(self.fa_heads, "__iter__"):
            raise MaskError(f"HeadMask.fa_heads must be a list of heads, got {self.fa_heads!r}")
        heads = []
        for i, h in enumerate(self.fa_heads):
            try:
                heads.append(Head.from_any(h))
            except (TypeError, ValueError) as err:
                raise MaskError(f"HeadMask.fa_heads[{i}]: {err}") from None
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
            try:
                rows = tuple(tuple(float(x) for x in row) for row in self.scores)
            except (TypeError, ValueError):
                raise MaskError(f"HeadMask.scores must be {self.n_layers} x {self.n_heads} numbers") from None
            if len(rows) != self.n_layers or any(len(r) != self.n_heads for r in rows):
                raise MaskError(f"HeadMask.scores must be {self.n_layers} x {self.n_heads}")
            bad = [f"L{l}H{h}" for l, r in enumerate(rows) for h, x in enumerate(r) if not math.isfinite(x)]
            if bad:
                raise MaskError(f"HeadMask.scores holds non-finite values at {bad[:5]}; select from finite scores")
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

    # ---- GQA: the key/value heads the FA heads keep -----------------------------------------
    def fa_kv_in_layer(self, layer: int) -> tuple[int, ...] | None:
        """Sorted KV-head indices read by ``layer``'s FA heads (kept in the hybrid's KV cache);
        None when the mask does not know the model's KV heads."""
        if self.n_kv_heads is None:
            return None
        rep = self.n_heads // self.n_kv_heads
        return tuple(sorted({h // rep for h in self.fa_in_layer(layer)}))

    @property
    def fa_kv_heads(self) -> tuple[tuple[int, ...], ...] | None:
        """Per layer, the KV heads the FA heads keep (``fa_kv_in_layer`` for every layer)."""
        if self.n_kv_heads is None:
            return None
        return tuple(self.fa_kv_in_layer(l) for l in range(self.n_layers))  # type: ignore[misc]

    @property
    def n_fa_kv(self) -> int | None:
        """How many (layer, KV head) pairs the FA heads keep."""
        kv = self.fa_kv_heads
        return None if kv is None else sum(len(x) for x in kv)

    @property
    def kv_cache_share(self) -> float | None:
        """The FA branch's KV cache as a share of the teacher's: n_fa_kv / (n_layers * n_kv_heads)."""
        n = self.n_fa_kv
        return None if n is None else n / (self.n_layers * self.n_kv_heads)  # type: ignore[operator]

    def summary(self, n_best: int = 10) -> str:
        """A few lines for people: the budget, the KV cache kept, FA heads per layer, the best heads and
        how many selected heads carry no causal signal."""
        st = self.settings or {}
        unit = st.get("unit", "head")
        budget = f"strategy {st.get('strategy', '?')}"
        if unit == "kv_group":
            budget += f", budget {st.get('k')} whole KV groups"
        lines = [f"{len(self)} of {self.n_total} heads kept as full attention (LA:FA {self.ratio}; {budget})"]
        if self.n_kv_heads is not None:
            lines.append(f"KV cache: {self.n_fa_kv} of {self.n_layers * self.n_kv_heads} KV heads kept "
                         f"({self.kv_cache_share:.1%} of the teacher's KV cache)")
        lines.append("FA heads per layer: " + " ".join(str(c) for c in self.per_layer_counts()))
        if self.scores is not None and len(self):
            best = sorted(self.fa_heads, key=lambda h: (-self.scores[h.layer][h.head], h))[:n_best]
            lines.append("best: " + ", ".join(f"{h} ({self.scores[h.layer][h.head]:.3f})" for h in best))
        if "n_no_signal" in st:
            n = st["n_no_signal"]
            heads = ", ".join(str(Head.from_any(h)) for h in st.get("no_signal_heads", [])[:12])
            lines.append(f"no causal signal: {n} of {len(self)} FA heads" + (
                f" (score 0 in every map: {heads}{' ...' if n > 12 else ''}) -- WARNING: they only fill the budget "
                "or a layer's minimum" if n else ""))
        elif self.scores is not None:
            n = sum(1 for h in self.fa_heads if self.scores[h.layer][h.head] <= 0)
            lines.append(f"no causal signal: {n} of {len(self)} FA heads score <= 0 in the mask's scores "
                         "(other maps not recorded)")
        else:
            lines.append("no causal signal: not known (the mask records no scores)")
        return "\n".join(lines)

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
            if not fingerprint_matches(model_or_config, self.fingerprint):
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
            "fa_kv_heads": None if self.fa_kv_heads is None else [list(x) for x in self.fa_kv_heads],
            "n_fa_kv": self.n_fa_kv,
            "kv_cache_share": self.kv_cache_share,
            "scores": [list(r) for r in self.scores] if self.scores is not None else None,
            "settings": self.settings,
        }

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, default=str)
        if path is not None:
            write_text(path, text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HeadMask":
        if not isinstance(data, dict) or data.get("schema") != "headscope.head_mask":
            raise MaskError("not a headscope head-mask: the 'schema' field must be 'headscope.head_mask'")
        version = data.get("schema_version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise MaskError(f"head-mask schema_version {version!r} is not supported (this headscope reads "
                            f"{', '.join(map(str, READABLE_VERSIONS))}); re-export the mask with this version")
        try:
            model = data["model"]
            fa = data["fa_heads"]
            if not isinstance(model, dict):
                raise MaskError(f"head-mask field 'model' must be an object, got {model!r}")
            if not isinstance(fa, list):
                raise MaskError(f"head-mask field 'fa_heads' must be a list of [layer, head], got {fa!r}")
            mask = cls(n_layers=model["n_layers"], n_heads=model["n_heads"], n_kv_heads=model.get("n_kv_heads"),
                       model_type=model.get("model_type"), fingerprint=model.get("config_fingerprint"),
                       fa_heads=tuple(fa), scores=data.get("scores"), settings=data.get("settings") or {})
        except KeyError as exc:
            raise MaskError(f"head-mask JSON is missing the field {exc.args[0]!r}") from None
        mask._check_derived(data)
        return mask

    def _check_derived(self, data: dict[str, Any]) -> None:
        """Refuse a file whose derived fields (n_fa, ratio_la_fa, fa_kv_heads, n_fa_kv, kv_cache_share)
        contradict its fa_heads: someone edited one without the other."""
        def bad(name: str, got: Any, want: Any) -> MaskError:
            return MaskError(f"head-mask field {name!r} is {got!r} but fa_heads (the source of truth) gives "
                             f"{want!r}; fix or delete {name!r} (it is derived from fa_heads)")

        if data.get("n_fa") is not None and data["n_fa"] != len(self):
            raise bad("n_fa", data["n_fa"], len(self))
        if data.get("ratio_la_fa") is not None and data["ratio_la_fa"] != self.ratio:
            raise bad("ratio_la_fa", data["ratio_la_fa"], self.ratio)
        kv_fields = {k: data.get(k) for k in ("fa_kv_heads", "n_fa_kv", "kv_cache_share") if data.get(k) is not None}
        if kv_fields and self.n_kv_heads is None:
            raise MaskError(f"head-mask has {sorted(kv_fields)} but no model.n_kv_heads; add n_kv_heads or delete "
                            "the KV fields")
        if "fa_kv_heads" in kv_fields:
            got = kv_fields["fa_kv_heads"]
            want = [list(x) for x in self.fa_kv_heads]  # type: ignore[union-attr]
            if not isinstance(got, list) or [list(x) if isinstance(x, (list, tuple)) else x for x in got] != want:
                raise bad("fa_kv_heads", got, want)
        if "n_fa_kv" in kv_fields and kv_fields["n_fa_kv"] != self.n_fa_kv:
            raise bad("n_fa_kv", kv_fields["n_fa_kv"], self.n_fa_kv)
        if "kv_cache_share" in kv_fields:
            got = kv_fields["kv_cache_share"]
            if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isclose(
                    got, self.kv_cache_share, rel_tol=1e-9, abs_tol=1e-12):  # type: ignore[arg-type]
                raise bad("kv_cache_share", got, self.kv_cache_share)

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
