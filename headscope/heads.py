"""Heads addressed as values: ``Head(layer=3, head=5)``."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Head"]


@dataclass(frozen=True, order=True)
class Head:
    """One query head of one attention layer (both 0-based)."""

    layer: int
    head: int

    def __post_init__(self) -> None:
        for name in ("layer", "head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Head.{name} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"Head.{name} must be >= 0, got {value}")

    def __str__(self) -> str:
        return f"L{self.layer}H{self.head}"

    def kv_group(self, n_heads: int, n_kv_heads: int) -> int:
        """Index of the key/value head this query head reads under grouped-query attention."""
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        return self.head // (n_heads // n_kv_heads)

    def to_list(self) -> list[int]:
        return [self.layer, self.head]

    @classmethod
    def from_any(cls, value: "Head | tuple[int, int] | list[int] | dict") -> "Head":
        """Accept a Head, a (layer, head) pair or {"layer": .., "head": ..}."""
        if isinstance(value, Head):
            return value
        if isinstance(value, dict):
            return cls(layer=value["layer"], head=value["head"])
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(layer=int(value[0]), head=int(value[1]))
        raise TypeError(f"cannot read a Head from {value!r}; use Head(layer=.., head=..) or (layer, head)")
