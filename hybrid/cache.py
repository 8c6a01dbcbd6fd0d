"""Decoding cache of the hybrid: KV only for the FA heads' KV heads, a fixed-size state for GDN heads.

Per layer (``LayerCache``):
- ``keys``/``values``  [B, S, K_F, D]: the K_F teacher KV heads read by the layer's FA heads (a sliding
  window of the last ``window - 1`` positions for the token-level baseline, ``key_start`` = position of row 0);
- ``state``  [B, H_L, Dk, Dv] float32: the gated-delta-rule state of the H_L GDN heads (constant size);
- ``conv``  three [B, W-1, H_L*D] tensors (q, k, v) when the short conv is on.

``HybridCache`` is not a ``transformers.Cache``: ``HybridForCausalLM`` threads it through ``generate``
itself under the keyword ``hybrid_cache`` (see modeling.py), which keeps it independent of the cache API
changes between transformers 5.17 and 5.24.

Beam search: ``HybridCache.history`` [B, n] records what each row consumed (token ids; an ``inputs_embeds``
chunk as one negative key per distinct row), and ``align(input_ids)`` reorders every row's KV, GDN state and
conv state to the row of the cache whose consumed ids are the prefix of that input row. generate() hands the
model each beam's whole sequence, so the cache follows the beams on any transformers version (5.x's beam search
only reorders caches kept under its own cache names, which this one is not).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LayerCache", "HybridCache", "CacheMismatchError", "cache_nbytes", "teacher_cache_nbytes"]


@dataclass
class LayerCache:
    keys: torch.Tensor | None = None  # [B, S, K_F, D]
    values: torch.Tensor | None = None  # [B, S, K_F, D]
    key_start: int = 0  # absolute position of keys[:, 0]
    state: torch.Tensor | None = None  # [B, H_L, Dk, Dv]
    conv: tuple[torch.Tensor, ...] | None = None  # 3 x [B, W-1, H_L*D]

    def seen_kv(self) -> int:
        """How many positions the stored keys cover (the next query's position; a Python int, no device sync)."""
        return self.key_start + (self.keys.shape[1] if self.keys is not None else 0)

    def append_kv(self, k: torch.Tensor, v: torch.Tensor,
                  keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
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

    def set_state(self, state: torch.Tensor) -> None:
        """Store the GDN state [B, H_L, Dk, Dv] after a call (a preallocated cache copies in place)."""
        self.state = state

    def set_conv(self, conv: tuple[torch.Tensor, ...]) -> None:
        """Store the short-conv states 3 x [B, W-1, H_L*D] after a call."""
        self.conv = conv

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


class CacheMismatchError(ValueError):
    """The input rows do not continue the rows of the hybrid cache they are run with."""


@dataclass
class HybridCache:
    """Per-layer caches plus the number of positions already processed and what each row consumed."""

    layers: list[LayerCache] = field(default_factory=list)
    seen_tokens: int = 0
    history: torch.Tensor | None = None  # [B, n] long: ids consumed (>= 0), or < 0: key of an inputs_embeds chunk
    history_is_id: torch.Tensor | None = None  # [n] bool: which history columns are token ids

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
        """Row b of every tensor (KV, GDN state, conv state, history) becomes old row beam_idx[b]."""
        for layer in self.layers:
            layer.reorder(beam_idx)
        if self.history is not None:
            self.history = self.history.index_select(0, beam_idx.to(self.history.device))

    # ---- which input each row consumed (for beam search) ---------------------------------------------
    def record(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> None:
        """Append what the rows consumed: ids [B, T], or for embeds [B, T, C] one column with a negative key
        per distinct row (equal rows, e.g. the beams of one prompt, share a key)."""
        if input_ids is not None:
            cols, is_id = input_ids.long(), True  # [B, T]
        else:
            flat = inputs_embeds.detach().reshape(inputs_embeds.shape[0], -1)  # [B, T*C]
            inverse = torch.unique(flat, dim=0, return_inverse=True)[1]  # [B]
            cols, is_id = -(1 + self._next_key() + inverse[:, None]), False  # [B, 1]
        flags = torch.full((cols.shape[1],), is_id, dtype=torch.bool, device=cols.device)  # [T]
        if self.history is None:
            self.history, self.history_is_id = cols, flags
        else:
            self.history = torch.cat([self.history, cols.to(self.history.device)], 1)
            self.history_is_id = torch.cat([self.history_is_id, flags.to(self.history_is_id.device)])

    def _next_key(self) -> int:
        if self.history is None or bool(self.history_is_id.all()):
            return 0
        return int(-self.history[:, ~self.history_is_id].min())  # keys of a new chunk never repeat older ones

    @property
    def n_ids(self) -> int:
        """How many of the consumed positions were given as token ids."""
        return 0 if self.history_is_id is None else int(self.history_is_id.sum())

    def align(self, input_ids: torch.Tensor) -> None:
        """Reorder the rows so that row r holds the state of ``input_ids[r, :n_ids]`` (beam search).

        Nothing moves when every row already matches (greedy, sampling). A row prefers itself; otherwise it
        takes a row with the same consumed ids. Raises CacheMismatchError when a row continues no cached row,
        or when the matching rows differ in an inputs_embeds prompt (beams cannot be told apart: pass
        input_ids instead of inputs_embeds for beam search)."""
        if self.history is None:
            return
        n, hist = self.n_ids, self.history
        ids_hist = hist[:, self.history_is_id]  # [B_old, n]
        B_old, B = hist.shape[0], input_ids.shape[0]
        if input_ids.shape[1] < n:
            raise CacheMismatchError(f"input_ids have {input_ids.shape[1]} positions but the hybrid cache already "
                                     f"consumed {n} token ids: pass the whole sequences, or a fresh cache")
        prefix = input_ids[:, :n].to(hist.device)  # [B, n]
        if B == B_old and torch.equal(prefix, ids_hist):
            return
        match = (prefix[:, None, :] == ids_hist[None, :, :]).all(-1)  # [B, B_old]
        lost = (~match.any(1)).nonzero().flatten().tolist()
        if lost:
            raise CacheMismatchError(
                f"rows {lost[:5]} of input_ids do not continue any row of the hybrid cache (their first {n} ids "
                "differ from every cached row): pass the cache made for these sequences, or none")
        src = match.float().argmax(1)  # [B] first matching old row
        own = match.diagonal() if B == B_old else torch.zeros(B, dtype=torch.bool, device=src.device)  # [B]
        src = torch.where(own, torch.arange(B, device=src.device), src)  # a row that still matches keeps itself
        other = hist[:, ~self.history_is_id]  # [B_old, m] embeds keys
        if other.shape[1]:
            differ = (other[None, :, :] != other[src][:, None, :]).any(-1)  # [B, B_old]
            if (match & differ & ~own[:, None]).any():
                raise CacheMismatchError(
                    "cannot tell which cached row a beam continues: rows with the same generated ids come from "
                    "different inputs_embeds prompts; use input_ids for beam search with a hybrid")
        self.reorder_cache(src)


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
