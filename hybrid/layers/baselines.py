"""Baselines built by the same code: layer-wise hybrids (whole layers FA or GDN) and the token-level
hybrid (sliding-window attention + Gated DeltaNet on every head of every layer).

- ``layerwise_mask(teacher, ratio="3:1")``: a HeadMask whose FA heads fill whole, evenly spaced layers.
- ``from_layers(teacher, fa_layers=[...])``: the layer-wise hybrid for an explicit list of FA layers.
- ``from_token_level(teacher, window=512)``: ``granularity="token"``, every layer a ``TokenHybridAttention``.
- ``from_teacher(teacher)``: every head FA with RoPE, no log scale, no gate, no fusion norm: the teacher's
  function in this code base (its logits equal the teacher's), so all experiments share one model class.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn

from hybrid.cache import LayerCache
from hybrid.config import HybridConfig, HybridConfigError
from hybrid.layers.fusion import head_rms
from hybrid.layers.hybrid_attention import FullAttentionBranch, GatedDeltaNetBranch

__all__ = ["TokenHybridAttention", "layerwise_mask", "from_layers", "from_token_level", "from_teacher"]


class TokenHybridAttention(nn.Module):
    """Every head runs sliding-window attention (teacher q/k/v, RoPE kept) and GDN; per-head outputs are
    RMS-normalised, scaled (``swa_gamma``, ``gdn_gamma``) and summed, then the teacher's o_proj."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        opts = config.options
        H, D, C = config.num_attention_heads, config.head_dim, config.hidden_size
        self.layer_idx, self.mode, self.eps = layer_idx, opts.fusion, opts.norm_eps
        self.swa = FullAttentionBranch(config, list(range(H)), rope=True, log_scale=False, gate="none",
                                       window=opts.window)
        self.la = GatedDeltaNetBranch(config, list(range(H)))
        self.gamma_init = opts.gamma_init
        self.swa_gamma = nn.Parameter(torch.full((H,), opts.gamma_init))  # [H] new
        self.gdn_gamma = nn.Parameter(torch.full((H,), opts.gamma_init))  # [H] new
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


def _parse_ratio(ratio: str | float) -> float:
    """'3:1' -> fraction of FA layers 1/4; a float in (0, 1] is taken as that fraction."""
    if isinstance(ratio, str):
        try:
            la, fa = (float(x) for x in ratio.split(":"))
        except ValueError:
            raise HybridConfigError(f"ratio={ratio!r}: write LA:FA as 'a:b', e.g. '3:1'") from None
        if la < 0 or fa <= 0:
            raise HybridConfigError(f"ratio={ratio!r}: both sides must be >= 0 and FA > 0")
        return fa / (la + fa)
    if not 0 < float(ratio) <= 1:
        raise HybridConfigError(f"ratio={ratio!r}: a float ratio is the FA fraction, in (0, 1]")
    return float(ratio)


def layerwise_mask(teacher: Any, ratio: str | float = "3:1"):
    """A HeadMask with whole FA layers, evenly spaced, the last of each period FA (3:1 on 28 layers: 3, 7, .., 27)."""
    from headscope.mask import HeadMask, model_shape

    shape = model_shape(teacher)
    L, H = shape["num_hidden_layers"], shape["num_attention_heads"]
    n_fa = max(1, round(L * _parse_ratio(ratio)))
    layers = sorted({round((i + 1) * L / n_fa) - 1 for i in range(n_fa)})
    return HeadMask.for_model(teacher, [(l, h) for l in layers for h in range(H)],
                              settings={"strategy": "layerwise", "ratio": str(ratio), "fa_layers": layers})


def from_layers(teacher: Any, fa_layers: Sequence[int], **options: Any):
    """The layer-wise hybrid: layers in ``fa_layers`` keep all heads FA, the others are all GDN."""
    from headscope.mask import HeadMask, model_shape
    from hybrid.convert import from_mask

    shape = model_shape(teacher)
    L, H = shape["num_hidden_layers"], shape["num_attention_heads"]
    bad = [l for l in fa_layers if not 0 <= l < L]
    if bad:
        raise HybridConfigError(f"fa_layers {bad} outside 0..{L - 1}")
    mask = HeadMask.for_model(teacher, [(l, h) for l in sorted(set(fa_layers)) for h in range(H)],
                              settings={"strategy": "layerwise", "fa_layers": sorted(set(fa_layers))})
    options.setdefault("granularity", "layer")
    return from_mask(teacher, mask, **options)


def from_token_level(teacher: Any, window: int = 512, **options: Any):
    """The token-level hybrid: sliding-window attention (``window`` keys) + GDN on every head."""
    from headscope.mask import HeadMask
    from hybrid.convert import from_mask

    return from_mask(teacher, HeadMask.for_model(teacher, []), granularity="token", window=window, **options)


def from_teacher(teacher: Any, **options: Any):
    """The teacher as a HybridForCausalLM: every head FA, RoPE kept, no log scale, no gate, no fusion norm."""
    from headscope.mask import HeadMask, model_shape
    from hybrid.convert import from_mask

    shape = model_shape(teacher)
    heads = [(l, h) for l in range(shape["num_hidden_layers"]) for h in range(shape["num_attention_heads"])]
    kw = dict(fa_rope=True, fa_log_scale=False, fa_gate="none", fusion="none", allow_degenerate=True)
    kw.update(options)
    return from_mask(teacher, HeadMask.for_model(teacher, heads), **kw)
