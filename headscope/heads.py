"""Heads addressed as values: ``Head(layer=3, head=5)``."""
from __future__ import annotations

import operator
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
        """Accept a Head, a (layer, head) pair or {"layer": .., "head": ..}.

        Indices must be integers (int, or an integer type such as numpy.int64 or a 0-d integer tensor):
        1.5, 2.0, "3" and True are refused, never rounded or parsed."""
        if isinstance(value, Head):
            return value
        if isinstance(value, dict):
            missing = [k for k in ("layer", "head") if k not in value]
            if missing:
                raise TypeError(f"cannot read a Head from {value!r}: missing {missing}; use "
                                '{"layer": .., "head": ..}')
            layer, head = value["layer"], value["head"]
        elif isinstance(value, (tuple, list)) and len(value) == 2:
            layer, head = value
        else:
            raise TypeError(f"cannot read a Head from {value!r}; use Head(layer=.., head=..) or (layer, head)")
        return cls(layer=_index(layer, "layer", value), head=_index(head, "head", value))


def _index(x: object, name: str, whole: object) -> int:
    """``x`` as an int when it is an integer (int, numpy integer, 0-d integer tensor), else TypeError."""
    if isinstance(x, bool) or isinstance(x, (str, bytes, float)):
        bad = True
    else:
        try:
            return operator.index(x)  # type: ignore[arg-type]
        except TypeError:
            bad = True
    raise TypeError(f"Head {name} index must be an integer, got {x!r} ({type(x).__name__}) in {whole!r}; "
                    f"write whole numbers, e.g. (3, 5)")
