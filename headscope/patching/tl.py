"""Receiver scores through a TransformerLens 4.x ``TransformerBridge`` (hook ``blocks.{l}.attn.hook_z``).

Plain full forwards (no prefix reuse): the heads of one micro-batch are batch elements, element i
patching head jobs[i] in ``hook_z  # [B, T, H, D]``. transformer_lens is imported by the caller only.
"""
from __future__ import annotations

from typing import Any

import torch

from headscope.metrics import Metric
from headscope.patching.engine import head_batches, model_device
from headscope.patching.inputs import PatchPair

__all__ = ["TLBackend", "bridge_from_hf", "bridge_tokenizer", "is_transformer_bridge"]


_TOKENIZER_ATTR = "_headscope_hf_tokenizer"


def _detached_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s module tree (config, buffers, forwards) that shares its parameters.

    ``TransformerBridge`` rebuilds the tree it is given in place (bridge components replace the submodules, the
    attention implementation is switched to eager); on the copy, the caller's model stays a plain HF model that
    the fast backend can still score, at no cost in parameter memory."""
    import copy

    memo = {id(p): p for p in model.parameters()}
    return copy.deepcopy(model, memo)


def bridge_from_hf(model: Any, tokenizer: Any) -> Any:
    """A TransformerLens 4.x ``TransformerBridge`` around an in-memory HF model.

    The model itself is left as it was: the bridge wraps a copy of its module tree that shares its
    parameters (an edit of the weights shows in both). ``boot_transformers`` wants a tokenizer it can load
    from a folder, so a copy of the tokenizer is saved to a temporary folder and reloaded; TransformerLens turns
    that copy into one that prepends BOS (``bridge.tokenizer``). ``headscope.score(bridge, task)`` tokenizes with
    the original ``tokenizer`` (kept on the bridge, see ``bridge_tokenizer``), so a bridge gets the same pairs,
    and the same scores, as the plain model.
    """
    import tempfile

    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    folder = tempfile.mkdtemp(prefix="headscope_tok_")
    tokenizer.save_pretrained(folder)
    bridge = TransformerBridge.boot_transformers(folder, hf_model=_detached_copy(model),
                                                 tokenizer=AutoTokenizer.from_pretrained(folder))
    setattr(bridge, _TOKENIZER_ATTR, tokenizer)
    return bridge


def bridge_tokenizer(bridge: Any) -> Any:
    """The HF tokenizer given to ``bridge_from_hf``, else ``bridge.tokenizer`` (TransformerLens's, which may prepend
    a BOS token the plain model's tokenizer does not). Scoring picks a bridge's tokenizer with
    ``headscope.tokenizers.find_tokenizer``, which prefers the plain model's own to ``bridge.tokenizer``."""
    return getattr(bridge, _TOKENIZER_ATTR, None) or getattr(bridge, "tokenizer", None)


def is_transformer_bridge(obj: Any) -> bool:
    return any(c.__module__.startswith("transformer_lens") and c.__name__ == "TransformerBridge"
               for c in type(obj).__mro__)


class TLBackend:
    name = "transformer_lens"

    def __init__(self, bridge: Any, batch_size: int | None = None):
        if not is_transformer_bridge(bridge):
            raise TypeError(f"TLBackend needs a transformer_lens TransformerBridge, got {type(bridge).__name__}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        cfg = bridge.cfg
        self.bridge = bridge
        self.n_layers, self.n_heads = int(cfg.n_layers), int(cfg.n_heads)
        self.n_kv_heads = int(getattr(cfg, "n_key_value_heads", None) or self.n_heads)
        self.batch_size = batch_size or self.n_heads
        self.device = model_device(bridge)

    def _logits(self, ids: torch.Tensor, answer_pos: torch.Tensor, fwd_hooks=()) -> torch.Tensor:
        ids = ids.to(self.device)
        out = self.bridge.run_with_hooks(ids, fwd_hooks=list(fwd_hooks)) if fwd_hooks else self.bridge(ids)
        return out[:, answer_pos.to(self.device)].float()  # [B, A, V]

    @torch.inference_mode()
    def answer_logits(self, ids: torch.Tensor, answer_pos: torch.Tensor) -> torch.Tensor:
        return self._logits(ids[None], answer_pos)[0]  # [A, V]

    @torch.inference_mode()
    def patched_metrics(self, pair: PatchPair, metric: Metric, pbar=None) -> torch.Tensor:
        _, cache = self.bridge.run_with_cache(pair.corrupt_ids[None].to(self.device),
                                              names_filter=lambda name: name.endswith("attn.hook_z"))
        z_corrupt = {l: cache[f"blocks.{l}.attn.hook_z"] for l in range(self.n_layers)}  # [1, T, H, D]
        out = torch.zeros(self.n_layers, self.n_heads, dtype=torch.float64)  # [L, H]
        for chunk, rows in head_batches(self.n_layers, self.n_heads, self.batch_size):

            def make_hook(l: int):
                def hook(z, hook):  # z  # [B, T, H, D]
                    z = z.clone()
                    for b, h in rows[l]:
                        z[b, :, h] = z_corrupt[l][0, :, h]
                    return z
                return hook

            hooks = [(f"blocks.{l}.attn.hook_z", make_hook(l)) for l in rows]
            logits = self._logits(pair.clean_ids[None].expand(len(chunk), -1), pair.answer_pos, hooks)
            for (l, h), v in zip(chunk, metric(logits, pair).tolist()):
                out[l, h] = v
            if pbar is not None:
                pbar.update(len(chunk))
        return out
