"""The one way this project puts hooks on modules: a context manager that registers and always removes.

    from headscope.hooks import hooks, pre, post

    def save(module, args):                       # a forward pre-hook: sees the module's inputs
        store["z"] = args[0].detach()              # z  # [B, T, H*D]

    with hooks(pre(model.model.layers[3].self_attn.o_proj, save)):
        model(input_ids)
    # every hook is gone here, also after an exception (or a failed registration half-way)

``pre(module, fn, with_kwargs=False)`` is ``register_forward_pre_hook``; ``post(module, fn,
with_kwargs=False)`` is ``register_forward_hook``. ``hooks`` takes any number of them, or iterables of
them (``hooks(pre(m, f) for m in mods)``), and yields the list of handles.

``record_inputs(modules, start=0)`` is the common case built on them: a dict that fills, during the
block, with a copy of each module's first input (e.g. every layer's ``z  # [B, T, H*D]``, the output
projection's input), positions ``start..`` along dim 1.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn

__all__ = ["Hook", "pre", "post", "hooks", "record_inputs", "HOOK_KINDS"]

HOOK_KINDS = ("pre", "post")


@dataclass(frozen=True)
class Hook:
    """A hook not yet registered: ``kind`` "pre" (forward pre-hook) or "post" (forward hook)."""

    module: nn.Module
    fn: Callable[..., Any]
    kind: str = "pre"
    with_kwargs: bool = False

    def __post_init__(self) -> None:
        if self.kind not in HOOK_KINDS:
            raise ValueError(f"Hook.kind={self.kind!r} is not one of {HOOK_KINDS}")
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"Hook.module must be a torch.nn.Module, got {type(self.module).__name__}")
        if not callable(self.fn):
            raise TypeError(f"Hook.fn must be callable, got {self.fn!r}")

    def register(self):
        if self.kind == "pre":
            return self.module.register_forward_pre_hook(self.fn, with_kwargs=self.with_kwargs)
        return self.module.register_forward_hook(self.fn, with_kwargs=self.with_kwargs)


def pre(module: nn.Module, fn: Callable[..., Any], with_kwargs: bool = False) -> Hook:
    """A forward pre-hook: ``fn(module, args)`` (or ``fn(module, args, kwargs)`` with_kwargs) before forward."""
    return Hook(module, fn, "pre", with_kwargs)


def post(module: nn.Module, fn: Callable[..., Any], with_kwargs: bool = False) -> Hook:
    """A forward hook: ``fn(module, args, output)`` (``fn(module, args, kwargs, output)``) after forward."""
    return Hook(module, fn, "post", with_kwargs)


def _flatten(items: Iterable[Any]) -> Iterator[Hook]:
    for item in items:
        if isinstance(item, Hook):
            yield item
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes, nn.Module)):
            yield from _flatten(item)
        else:
            raise TypeError(f"hooks() takes Hook values (from pre()/post()) or iterables of them, got {item!r}")


@contextmanager
def hooks(*items: Hook | Iterable[Hook]) -> Iterator[list]:
    """Register every hook, yield their handles, and remove them all on exit (exceptions included)."""
    handles: list = []
    try:
        for hook in _flatten(items):
            handles.append(hook.register())
        yield handles
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def record_inputs(modules: Sequence[nn.Module] | Mapping[Any, nn.Module],
                  start: int = 0) -> Iterator[dict[Any, torch.Tensor]]:
    """Inside the block, ``store[key]`` is a detached copy of ``modules[key]``'s first input at positions
    ``start..`` (dim 1), from its latest forward; keys are list indices (a sequence) or the mapping's keys."""
    items = modules.items() if isinstance(modules, Mapping) else enumerate(modules)
    store: dict[Any, torch.Tensor] = {}

    def make_hook(key: Any):
        def hook(module, args):
            store[key] = args[0][:, start:].detach().clone()  # e.g. z  # [B, T - start, H*D]
        return hook

    with hooks(pre(module, make_hook(key)) for key, module in items):
        yield store
