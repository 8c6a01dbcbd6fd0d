"""Named registries: a variant (a selection strategy, a combine rule, a task, ...) is one entry + its test.

    STRATEGIES = Registry("selection strategy")
    @STRATEGIES.register("global")
    def _global(inp): ...
    STRATEGIES.entry("global")          # the entry; an unknown name raises ValueError listing the known ones
    "global" in STRATEGIES, list(STRATEGIES), STRATEGIES.names()

A Registry is a read-only mapping from name to entry (iterating yields the names, like the tuples of
names it replaces), so ``name in REGISTRY`` and ``argparse(choices=REGISTRY)`` keep working.

A name that is taken is refused unless ``overwrite=True`` is passed: a built-in is never replaced by accident, so
results labelled with a built-in's name always come from the built-in.
"""
from __future__ import annotations

from typing import Generic, Iterator, Mapping, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")
_DECORATOR = object()  # register(name) without an entry: used as a decorator


class Registry(Mapping[str, T], Generic[T]):
    """Entries by name, in registration order."""

    def __init__(self, kind: str, *, owner: str | None = None) -> None:
        """``kind`` names one entry ("selection strategy"); ``owner`` names the registry in messages
        (e.g. "headscope.selection.STRATEGIES"; default "the <kind> registry")."""
        self.kind = kind
        self.owner = owner or f"the {kind} registry"
        self._items: dict[str, T] = {}

    def register(self, name: str, entry: T = _DECORATOR, *, overwrite: bool = False):  # type: ignore[assignment]
        """``reg.register("x", fn)`` or ``@reg.register("x")`` (an entry may be any value, None included). A taken
        name needs ``overwrite=True``."""
        if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{self.kind} name {name!r} must be a non-empty word (letters, digits, _ or -)")

        def add(obj: T) -> T:
            if name in self._items and not overwrite:
                raise ValueError(f"{self.kind} {name!r} is already registered in {self.owner}: pass overwrite=True "
                                 f"to replace it, or register yours under another name")
            self._items[name] = obj
            return obj

        return add if entry is _DECORATOR else add(entry)

    def unregister(self, name: str) -> None:
        self.entry(name)
        del self._items[name]

    def entry(self, name: str, *, who: str | None = None) -> T:
        """The entry called ``name``; an unknown name raises ValueError naming the known ones
        (``who``, e.g. "select: strategy", starts the message)."""
        if isinstance(name, str) and name in self._items:
            return self._items[name]
        prefix = f"{who}={name!r}" if who else f"unknown {self.kind} {name!r}"
        raise ValueError(f"{prefix} is not one of {self.names()} (the registered {self.kind}s); "
                         f"add one with .register(name, entry)")

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items

    def __repr__(self) -> str:
        return f"{self.names()}"

