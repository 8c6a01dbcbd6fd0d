"""Fast, exact receiver scores for Hugging Face causal LMs.

Exact tricks (each proven against ``NaiveBackend`` in tests/headscope/patching):
1. Prefix reuse: positions < p0 (the first corrupted token) are identical in the clean and patched
   runs of a causal model, so only the suffix T - p0 is recomputed, attending to the clean run's KV
   cache of the prefix (expanded over the batch).
2. Layer skip: patching a head of layer l cannot change layers < l. Their forwards are replaced, inside
   a context manager, by a replay of the clean run's recorded output of layer l - 1, so the model's own
   forward still builds masks, positions and RoPE. In layer l itself everything before the output
   projection is clean too: its attention module is replaced by out_proj(clean z) (patched by the hook),
   which skips the q/k/v projections and the attention of that layer.
3. Heads as batch elements: element i patches head jobs[i] (pre-hook on that layer's out_proj). A batch
   spanning layers starts at its lowest layer. Micro-batch size from a memory estimate, halved on OOM.
4. Logits only at the answer rows: the base model's final hidden states at answer_pos, then lm_head.
5. Positions after the last answer position are dropped (``as_patch_pair``); inference_mode throughout.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn

from headscope.arch import describe
from headscope.batching import micro_batches
from headscope.heads import Head
from headscope.metrics import Metric
from headscope.hooks import hooks, post, record_inputs
from headscope.patching.engine import head_jobs, model_device, patch_heads
from headscope.patching.inputs import PatchPair

__all__ = ["HFBackend", "HFFastConfig"]


@dataclass(frozen=True)
class HFFastConfig:
    batch_size: int | None = None  # heads per forward; None: one layer's heads, fewer if memory is short
    max_tokens: int | None = None  # cap on batch * suffix tokens per forward; None: 32768 on GPU, 2048 on CPU
    memory_fraction: float = 0.5  # of free GPU memory the micro-batch may use
    cpu_memory_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"HFFastConfig.batch_size must be >= 1 or None, got {self.batch_size}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"HFFastConfig.max_tokens must be >= 1 or None, got {self.max_tokens}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"HFFastConfig.memory_fraction must be in (0, 1], got {self.memory_fraction}")


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _expand_like(out: Any, batch: int) -> Any:
    """A recorded layer output (tensor or tuple whose first item is the hidden state) expanded to batch."""
    if isinstance(out, (tuple, list)):
        return type(out)([_expand_like(out[0], batch)] + list(out[1:]))
    return out.expand(batch, *out.shape[1:])


def prefix_kv(cache: Any, n_layers: int, p0: int, T: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values of positions < p0 for every layer, from the clean run's cache (empty when p0 == 0)."""
    prefix = []
    if p0 > 0:
        for l in range(n_layers):
            k, v = _cache_kv(cache, l)  # [1, K, T, D]
            if k.shape[-2] != T:
                raise RuntimeError(f"layer {l}'s KV cache holds {k.shape[-2]} of {T} positions (a sliding "
                                   "window?); the prefix cannot be reused: use backend='naive'")
            prefix.append((k[:, :, :p0], v[:, :, :p0]))  # [1, K, p0, D] each
    return prefix


@contextlib.contextmanager
def _replay_layers(layers: Sequence[nn.Module], output: Any, batch: int) -> Iterator[None]:
    """Layers' forwards return ``output`` (the clean output of the last of them) instead of computing."""
    replay = _expand_like(output, batch)
    patched = []
    try:
        for layer in layers:
            layer.forward = lambda *args, _out=replay, **kwargs: _out
            patched.append(layer)
        yield
    finally:
        for layer in patched:
            del layer.forward


@contextlib.contextmanager
def _attention_from_z(attention: nn.Module, out_proj: nn.Module, z: torch.Tensor, batch: int) -> Iterator[None]:
    """The attention module returns (out_proj(z), None): its output given the clean z  # [1, T', H*D]."""
    zb = z.expand(batch, -1, -1)  # [B, T', H*D]
    attention.forward = lambda *args, **kwargs: (out_proj(zb), None)
    try:
        yield
    finally:
        del attention.forward


@contextlib.contextmanager
def _record_layer_outputs(layers: Sequence[nn.Module], start: int) -> Iterator[dict[int, Any]]:
    """Record each decoder layer's output at positions >= start (same structure as returned)."""
    store: dict[int, Any] = {}

    def make_hook(l: int):
        def hook(module, args, out):
            if isinstance(out, (tuple, list)):
                store[l] = type(out)([out[0][:, start:].clone()] + [None] * (len(out) - 1))
            else:
                store[l] = out[:, start:].clone()
        return hook

    with hooks(post(layer, make_hook(l)) for l, layer in enumerate(layers)):
        yield store


def _cache_kv(cache: Any, l: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[l].keys, cache.layers[l].values
    return cache.key_cache[l], cache.value_cache[l]  # older transformers


def by_layer(jobs: Sequence[tuple[int, int]], batch: int) -> list[list[tuple[int, int]]]:
    """``jobs`` as one group per layer when a batch holds a whole layer's jobs (no batch row then recomputes
    layers below its own: a subset of heads, as a rank of sharded scoring has, keeps that), else one group."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for l, h in jobs:
        groups.setdefault(l, []).append((l, h))
    if groups and batch >= max(len(g) for g in groups.values()):
        return list(groups.values())
    return [list(jobs)]


class HFBackend:
    """Receiver scores of a Hugging Face causal LM by suffix-only, layer-skipping, head-batched re-runs."""

    name = "hf"

    def __init__(self, model: nn.Module, config: HFFastConfig = HFFastConfig()):
        self.model, self.config = model, config
        self.arch = describe(model)
        self.n_layers, self.n_heads, self.n_kv_heads = self.arch.n_layers, self.arch.n_heads, self.arch.n_kv_heads
        self.base = model.base_model
        self.lm_head = model.get_output_embeddings()
        if self.base is model or self.lm_head is None:
            raise TypeError(f"{type(model).__name__} has no separate base model / lm_head; pass the *ForCausalLM "
                            "model, or use backend='naive'")
        params = inspect.signature(self.base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._pass_cache_position = "cache_position" in params
        self.device = model_device(model)
        self._batch: int | None = config.batch_size

    # ---- plain runs ------------------------------------------------------------------------
    def _base(self, ids: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
        """ids  # [B, T'] at positions start.. -> final hidden states  # [B, T', C]"""
        B, T = ids.shape
        pos = torch.arange(start, start + T, device=self.device)  # [T']
        kw = {"input_ids": ids.to(self.device), "position_ids": pos[None].expand(B, -1),
              "use_cache": cache is not None, self._cache_kw: cache}
        if self._pass_cache_position:
            kw["cache_position"] = pos
        return self.base(**kw).last_hidden_state

    def _head(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """hidden  # [B, T', C] -> logits at rows  # [B, A, V] float32"""
        return self.lm_head(hidden[:, rows.to(self.device)]).float()

    @torch.inference_mode()
    def answer_logits(self, ids: torch.Tensor, answer_pos: torch.Tensor) -> torch.Tensor:
        return self._head(self._base(ids[None], 0, None), answer_pos)[0]  # [A, V]

    # ---- patched runs ----------------------------------------------------------------------
    def _new_cache(self, prefix: list[tuple[torch.Tensor, torch.Tensor]], start_layer: int, batch: int):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for l, (k, v) in enumerate(prefix):  # k, v  # [1, K, p0, D]
            if l >= start_layer:  # layers that run need the prefix for every batch element
                k, v = k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)
            cache.update(k, v, l)  # skipped layers keep [1, ...]: only their length is read (masks)
        return cache

    def _auto_batch(self, suffix: int, total: int) -> int:
        if self._batch is not None:
            return self._batch
        cfg = self.model.config
        C = int(getattr(cfg, "hidden_size", None) or cfg.n_embd)
        I = int(getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * C)
        p = next(self.model.parameters())
        size = p.element_size()
        kv = self.n_layers * 2 * self.n_kv_heads * self.arch.head_dim * total * size * 2  # cache (+ cat copy)
        act = suffix * (8 * C + 3 * I) * size + self.n_heads * suffix * total * 4 * 2  # MLP, scores
        per_elem = kv + act
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget, max_tokens = free * self.config.memory_fraction, self.config.max_tokens or 32768
        else:
            budget, max_tokens = self.config.cpu_memory_bytes, self.config.max_tokens or 2048
        batch = int(max(1, min(budget // per_elem, max_tokens // suffix, self.n_layers * self.n_heads)))
        if batch >= self.n_heads:  # one whole layer per batch: no row recomputes layers below its own
            batch = self.n_heads
        return batch

    @torch.inference_mode()
    def patched_metrics(self, pair: PatchPair, metric: Metric, pbar=None,
                        heads: Sequence[Head] | None = None) -> torch.Tensor:
        arch, p0, T = self.arch, pair.first_diff, pair.seq_len
        # Clean run: the KV cache of the prefix, and every layer's output on the suffix.
        cache = None
        if p0 > 0:
            from transformers import DynamicCache
            cache = DynamicCache(config=self.model.config)
        attn_kinds: list[Any] = []

        def attn_kind(module, args, out):
            attn_kinds.append(isinstance(out, tuple) and len(out) == 2)

        with hooks(post(a, attn_kind) for a in arch.attentions), \
                _record_layer_outputs(arch.layers, p0) as layer_out, record_inputs(arch.out_projs, p0) as z_clean:
            self._base(pair.clean_ids[None], 0, cache)
        skip_attention = all(attn_kinds)  # attention returns (output, weights): replaceable by out_proj(z)
        prefix = prefix_kv(cache, self.n_layers, p0, T)
        del cache
        # Corrupted run: z of every layer on the suffix.
        with record_inputs(arch.out_projs, p0) as z_corrupt:
            self._base(pair.corrupt_ids[None], 0, None)

        suffix_ids = pair.clean_ids[p0:][None]  # [1, T - p0]
        rows = pair.answer_pos - p0  # [A] answer rows within the suffix
        jobs = head_jobs(self.n_layers, self.n_heads, heads)
        out = torch.zeros(self.n_layers, self.n_heads, dtype=torch.float64)  # [L, H]
        z_skip = z_clean if skip_attention else None

        def run(chunk):
            return self._run_batch(chunk, suffix_ids, p0, prefix, layer_out, z_corrupt, rows, z_skip)  # [B, A, V]

        def remember(size: int) -> None:  # a size found by halving serves the next pairs too
            if self.config.batch_size is None:
                self._batch = size

        groups = [jobs] if heads is None else by_layer(jobs, self._auto_batch(T - p0, T))
        for group in groups:
            for chunk, logits in micro_batches(group, run, self._auto_batch(T - p0, T), device=self.device,
                                               on_shrink=remember):
                for (l, h), v in zip(chunk, metric(logits, pair).tolist()):  # metric: [B]
                    out[l, h] = v
                if pbar is not None:
                    pbar.update(len(chunk))
        return out

    def _run_batch(self, jobs, suffix_ids, p0, prefix, layer_out, z_corrupt, rows, z_clean=None) -> torch.Tensor:
        B, start = len(jobs), jobs[0][0]
        cache = self._new_cache(prefix, start, B) if p0 > 0 else None
        replay = contextlib.nullcontext() if start == 0 else _replay_layers(
            self.arch.layers[:start], layer_out[start - 1], B)
        attn = contextlib.nullcontext() if z_clean is None else _attention_from_z(
            self.arch.attentions[start], self.arch.out_projs[start], z_clean[start], B)
        with replay, attn, patch_heads(self.arch.out_projs, self.arch, jobs, z_corrupt):
            hidden = self._base(suffix_ids.expand(B, -1), p0, cache)  # [B, T - p0, C]
        return self._head(hidden, rows)  # [B, A, V]
