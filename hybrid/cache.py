"""Decoding cache of the hybrid: KV only for the FA heads' KV heads, a fixed-size state for GDN heads.

Per layer (``LayerCache``):
- ``keys``/``values``  [B, S, K_F, D]: the K_F teacher KV heads read by the layer's FA heads (a sliding
  window of the last ``window - 1`` positions for the token-level baseline, ``key_start`` = position of row 0);
- ``state``  [B, H_L, Dk, Dv] float32: the gated-delta-rule state of the H_L GDN heads (constant size);
- ``conv``  three [B, W-1, H_L*D] tensors (q, k, v) when the short conv is on.

``HybridCache`` is not a ``transformers.Cache``: ``HybridForCausalLM`` threads it through ``generate``
itself under the keyword ``hybrid_cache`` (see modeling.py), which keeps it independent of the cache API
changes between transformers 5.17 and 5.24.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LayerCache", "HybridCache", "cache_nbytes", "teacher_cache_nbytes"]


@dataclass
class LayerCache:
    keys: torch.Tensor | None = None  # [B, S, K_F, D]
    values: torch.Tensor | None = None  # [B, S, K_F, D]
    key_start: int = 0  # absolute position of keys[:, 0]
    state: torch.Tensor | None = None  # [B, H_L, Dk, Dv]
    conv: tuple[torch.Tensor, ...] | None = None  # 3 x [B, W-1, H_L*D]

    def append_kv(self, k: torch.Tensor, v: torch.Tensor, keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append k/v [B, T, K_F, D]; return all keys/values to attend to and the position of their row 0.

        With ``keep`` (sliding window) only the last ``keep`` rows are stored afterwards."""
        if self.keys is None:
            keys, values, start = k, v, self.key_start
        else:
            keys, values, start = torch.cat([self.keys, k], 1), torch.cat([self.values, v], 1), self.key_start
        if keep is not None and keys.shape[1] > keep:
            drop = keys.shape[1] - keep
            self.keys, self.values, self.key_start = keys[:, drop:], values[:, drop:], start + drop
        else:
            self.keys, self.values, self.key_start = keys, values, start
        return keys, values, start

    def nbytes(self) -> dict[str, int]:
        kv = sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)
        st = self.state.numel() * self.state.element_size() if self.state is not None else 0
        cv = sum(t.numel() * t.element_size() for t in self.conv) if self.conv is not None else 0
        return {"fa_kv": kv, "gdn_state": st, "conv_state": cv}

    def reorder(self, index: torch.Tensor) -> None:
        for name in ("keys", "values", "state"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, index.to(t.device)))
        if self.conv is not None:
            self.conv = tuple(t.index_select(0, index.to(t.device)) for t in self.conv)


@dataclass
class HybridCache:
    """Per-layer caches plus the number of positions already processed."""

    layers: list[LayerCache] = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def empty(cls, n_layers: int) -> "HybridCache":
        return cls(layers=[LayerCache() for _ in range(n_layers)])

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def nbytes(self) -> dict[str, int]:
        """Bytes held now: FA keys/values, GDN states and conv states, summed over layers."""
        total = {"fa_kv": 0, "gdn_state": 0, "conv_state": 0}
        for layer in self.layers:
            for k, v in layer.nbytes().items():
                total[k] += v
        total["total"] = sum(total.values())
        return total

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.reorder(beam_idx)


def cache_nbytes(model_or_config, seq_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Analytic decode-cache bytes of a hybrid at ``seq_len`` cached positions (no tensors are made).

    ``fa_kv`` = sum_l 2 * K_F(l) * D * S * bytes(dtype); ``gdn_state`` = sum_l H_L(l) * D * D * 4 (float32);
    ``conv_state`` when the short conv is on; ``teacher`` the full-attention teacher's KV cache."""
    cfg = getattr(model_or_config, "config", model_or_config)
    opts = cfg.options
    D, L, H = cfg.head_dim, cfg.num_hidden_layers, cfg.num_attention_heads
    el = torch.empty(0, dtype=dtype).element_size()
    fa_kv = gdn = conv = 0
    for l in range(L):
        if opts.granularity == "token":
            k_f, h_l, s = cfg.num_key_value_heads, H, min(seq_len, opts.window - 1)
        else:
            k_f, h_l, s = len(cfg.fa_kv_heads(l)), len(cfg.la_heads(l)), seq_len
        fa_kv += 2 * batch * k_f * D * s * el
        gdn += batch * h_l * D * D * 4
        if opts.gdn_conv:
            conv += 3 * batch * (opts.conv_size - 1) * h_l * D * el
    out = {"fa_kv": fa_kv, "gdn_state": gdn, "conv_state": conv, "total": fa_kv + gdn + conv}
    out["teacher"] = teacher_cache_nbytes(cfg, seq_len, batch, dtype)
    return out


def teacher_cache_nbytes(model_or_config, seq_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """KV-cache bytes of the full-attention model: 2 * L * K * D * S * bytes(dtype)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    K = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    el = torch.empty(0, dtype=dtype).element_size()
    return 2 * batch * cfg.num_hidden_layers * K * D * seq_len * el
