"""Float32 attention on CUDA without its scores materialised, for the evaluations.

transformers' ``sdpa`` attention passes ``enable_gqa`` to ``torch.nn.functional.scaled_dot_product_attention``
whenever a grouped-query model runs without an attention mask. On CUDA only the flash backend honours
``enable_gqa``, and flash takes only float16 / bfloat16: a float32 model (a teacher evaluated exactly) falls back
to the math backend, which builds the [batch, heads, T, T] scores and their softmax in float32. At 6,139 tokens
that is 11.8 GiB per layer for 4 rows of SmolLM2-135M. Repeating the key/value heads first (what transformers
itself does when a mask is given) lets the memory-efficient backend take the call: the same attention, computed
in tiles. ``float32_sdpa_repeats_kv()`` installs that for the duration of a block and always puts the original
back; on the CPU, for half precision and for one-token decoding nothing changes.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

__all__ = ["float32_sdpa_repeats_kv", "repeats_kv"]


def repeats_kv(query: torch.Tensor, groups: int) -> bool:
    """Whether the key/value heads are repeated before SDPA: grouped heads, CUDA, not half precision, a prompt
    (more than one query token). query: [B, H, T, D]."""
    return groups > 1 and query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16) and query.shape[2] > 1


class _Ungrouped:
    """The attention module as the sdpa function sees it once the key/value heads are repeated."""

    num_key_value_groups = 1

    def __init__(self, module: torch.nn.Module):
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def wrap_sdpa(base: Callable, applies: Callable[[torch.Tensor, int], bool] = repeats_kv) -> Callable:
    """``base`` (transformers' sdpa attention function) with the key/value heads repeated where ``applies``."""

    from transformers.integrations.sdpa_attention import repeat_kv

    def sdpa_repeating_kv(module, query, key, value, attention_mask, **kwargs):
        groups = int(getattr(module, "num_key_value_groups", 1) or 1)
        if applies(query, groups):
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, K, S, D] -> [B, H, S, D]
            module = _Ungrouped(module)
        return base(module, query, key, value, attention_mask, **kwargs)

    sdpa_repeating_kv.wrapped = base
    return sdpa_repeating_kv


@contextmanager
def float32_sdpa_repeats_kv(applies: Callable[[torch.Tensor, int], bool] = repeats_kv) -> Iterator[None]:
    """Inside the block, transformers models loaded with ``attn_implementation="sdpa"`` repeat their key/value
    heads before SDPA where ``applies`` (default: float32 prompts on CUDA), so the memory-efficient backend runs
    instead of the math one. The previous ``sdpa`` function is restored on exit, also after an error."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # no transformers: nothing to change
        yield
        return
    if "sdpa" not in ALL_ATTENTION_FUNCTIONS:
        yield
        return
    local = getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", {})
    had_local = "sdpa" in local
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(before, "wrapped", None) is not None:  # nested: already installed
        yield
        return
    ALL_ATTENTION_FUNCTIONS["sdpa"] = wrap_sdpa(before, applies)
    try:
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = before
        else:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]
