"""The token-level baseline's mixer: sliding-window attention + Gated DeltaNet on every head of a layer.

Built by ``hybrid.from_token_level`` (``granularity="token"``); the builders live in ``hybrid/builders.py``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hybrid.cache import LayerCache
from hybrid.config import HybridConfig
from hybrid.layers.common import mark_new
from hybrid.layers.merge import head_rms
from hybrid.layers.hybrid_attention import FullAttentionBranch, GatedDeltaNetBranch

__all__ = ["TokenHybridAttention"]


class TokenHybridAttention(nn.Module):
    """Every head runs sliding-window attention (teacher q/k/v, RoPE kept) and GDN; per-head outputs are
    RMS-normalised, scaled (``swa_gamma``, ``gdn_gamma``) and summed, then the teacher's o_proj."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        opts = config.options
        H, D, C = config.num_attention_heads, config.head_dim, config.hidden_size
        self.layer_idx, self.mode, self.eps = layer_idx, opts.merge, opts.norm_eps
        self.swa = FullAttentionBranch(config, list(range(H)), rope=True, log_scale=False, gate="none",
                                       window=opts.window)
        self.la = GatedDeltaNetBranch(config, list(range(H)))
        self.gamma_init = opts.gamma_init
        self.swa_gamma = nn.Parameter(torch.full((H,), opts.gamma_init))  # [H] new
        self.gdn_gamma = nn.Parameter(torch.full((H,), opts.gamma_init))  # [H] new
        mark_new(self, "swa_gamma", "gdn_gamma")
        self.o_proj = nn.Linear(H * D, C, bias=config.o_bias)

    def reset_new_parameters(self) -> None:
        self.la.reset_new_parameters()
        with torch.no_grad():
            self.swa_gamma.fill_(self.gamma_init)
            self.gdn_gamma.fill_(self.gamma_init)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]."""
        o_swa = self.swa(x, positions, cos, sin, cache)  # [B, T, H, D]
        o_la = self.la(x, positions, cos, sin, cache)  # [B, T, H, D]
        if self.mode == "none":
            z = o_swa + o_la.to(o_swa.dtype)
        else:
            z = (head_rms(o_swa, self.eps) * self.swa_gamma.to(o_swa.dtype)[:, None]
                 + head_rms(o_la, self.eps).to(o_swa.dtype) * self.gdn_gamma.to(o_swa.dtype)[:, None])
        return self.o_proj(z.flatten(2))  # [B, T, C]
