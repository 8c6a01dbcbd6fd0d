"""Fusion of the two branches' head outputs before the (reused) output projection.

Modes (``HybridOptions.fusion``):
- ``"norm"`` (default, the method's): each head's output is RMS-normalised over its D channels on its
  own, then multiplied by a learnable per-head scale gamma_h (``gamma`` [H], original head order).
- ``"none"``: plain concatenation (the ablation where GDN outputs dwarf FA outputs).
- ``"gated"``: ``"norm"`` plus a per-position competition between the branches: a = softmax(W x + b) over
  {FA, GDN} (W = 0, b = 0 at init), FA heads scaled by 2 a_FA, GDN heads by 2 a_GDN (so 1 at init).

Heads are put back in their original order, so ``o_proj``'s input columns (ordered by head) are reused
unchanged. ``calibrate_fusion`` sets gamma from the teacher's per-head output RMS.

``forward`` is the reference (it builds z [B, T, H*D]); the layer calls ``project``, the same function
followed by ``o_proj`` without building z: each branch is normalised on its own and multiplied by its own
columns of o_proj's weight, with gamma folded into those columns (a [C, H*D] weight instead of a pass over
the [B, T, H, D] activations), so the fusion costs one normalisation pass and no copies. It launches more small
kernels than the buffer path, which costs more than the copies below ``PROJECT_MIN_TOKENS`` tokens per call (H200,
docs/hybrid.md: fusion + o_proj 0.35 vs 0.21 ms at 4K tokens, 0.58 vs 0.62 ms at 16K, 3.3 vs 4.5 ms at 128K),
so shorter calls (and decoding) keep the buffer path.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.layers.common import acc, index_on

__all__ = ["HeadFusion", "head_rms", "calibrate_fusion", "PROJECT_MIN_TOKENS"]

PROJECT_MIN_TOKENS = 8192  # B*T from which HeadFusion.project skips the z buffer (measured crossover 4K..16K)


def head_rms(o: torch.Tensor, eps: float) -> torch.Tensor:
    """o [B, T, H, D] -> o / rms(o) over D, per head (float32 math for half types, input dtype out).

    One fused op (``F.rms_norm`` accumulates half inputs in float32 and rounds once, the same values as
    ``(x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)``)."""
    return F.rms_norm(o, (o.shape[-1],), eps=eps)


class HeadFusion(nn.Module):
    """Normalise / scale / gate the FA and GDN head outputs and concatenate them in original head order."""

    def __init__(self, hidden: int, n_heads: int, head_dim: int, fa_heads: Sequence[int], mode: str,
                 gamma_init: float = 1.0, eps: float = 1e-6) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.mode, self.eps = n_heads, head_dim, mode, eps
        fa = sorted(fa_heads)
        la = [h for h in range(n_heads) if h not in set(fa)]
        self.fa_heads, self.la_heads = tuple(fa), tuple(la)
        self.gamma = nn.Parameter(torch.full((n_heads,), float(gamma_init))) if mode != "none" else None  # [H]
        self.branch_gate = nn.Linear(hidden, 2) if mode == "gated" else None  # new
        self.gamma_init = float(gamma_init)
        self.project_min_tokens = PROJECT_MIN_TOKENS  # below: project() builds z (fewer kernel launches)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.gamma is not None:
                self.gamma.fill_(self.gamma_init)
            if self.branch_gate is not None:
                self.branch_gate.weight.zero_()
                self.branch_gate.bias.zero_()

    def _assemble(self, o_fa: torch.Tensor | None, o_la: torch.Tensor | None) -> torch.Tensor:
        """Both branches' heads in original head order, z [B, T, H, D] (no copy when one branch is absent)."""
        if o_la is None:
            return o_fa  # [B, T, H, D] every head FA, already in order
        if o_fa is None:
            return o_la
        B, T = o_fa.shape[:2]
        z = o_fa.new_empty(B, T, self.n_heads, self.head_dim)  # [B, T, H, D]
        z.index_copy_(2, index_on(self.fa_heads, z.device), o_fa)
        z.index_copy_(2, index_on(self.la_heads, z.device), o_la.to(o_fa.dtype))
        return z

    def forward(self, x: torch.Tensor, o_fa: torch.Tensor | None, o_la: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, C]; o_fa [B, T, H_F, D]; o_la [B, T, H_L, D] -> z [B, T, H*D] in original head order.

        Heads are first put in order (one preallocated buffer), then normalised and scaled by gamma [H] in one
        pass over all heads (gamma is already in head order: no gather)."""
        z = self._assemble(o_fa, o_la)  # [B, T, H, D]
        if self.mode != "none":
            z = head_rms(z, self.eps) * self.gamma.to(z.dtype)[:, None]  # [B, T, H, D]
        if self.mode == "gated" and o_fa is not None and o_la is not None:
            a = self._branch_scales(x)  # [B, T, 2]
            branch = index_on(tuple(0 if h in self.fa_heads else 1 for h in range(self.n_heads)), z.device)  # [H]
            z = z * a[..., branch, None]  # [B, T, H, D]: FA heads * 2 a_FA, GDN heads * 2 a_GDN
        return z.reshape(*z.shape[:2], self.n_heads * self.head_dim)

    def _branch_scales(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] -> [B, T, 2]: 2 a_FA, 2 a_GDN of the "gated" mode (1 each at init)."""
        return 2 * torch.softmax(acc(self.branch_gate(x)), dim=-1).to(x.dtype)

    def project(self, x: torch.Tensor, o_fa: torch.Tensor | None, o_la: torch.Tensor | None,
                o_proj: nn.Linear) -> torch.Tensor:
        """``o_proj(self(x, o_fa, o_la))`` [B, T, C] without building z (module docstring).

        Falls back to that expression when a branch is absent (nothing to fuse), when o_proj carries hooks
        (interventions on o_proj's input, e.g. headscope's ablations, must see z), or below
        ``project_min_tokens`` tokens (B*T) per call, where the buffer path is faster."""
        if (o_fa is None or o_la is None or o_proj._forward_pre_hooks or o_proj._forward_hooks
                or o_fa.shape[0] * o_fa.shape[1] < self.project_min_tokens):
            return o_proj(self(x, o_fa, o_la))
        B, T = o_fa.shape[:2]
        o_la = o_la.to(o_fa.dtype)
        if self.mode != "none":
            o_fa, o_la = head_rms(o_fa, self.eps), head_rms(o_la, self.eps)  # [B, T, H_F, D], [B, T, H_L, D]
        if self.mode == "gated":
            a = self._branch_scales(x)  # [B, T, 2]
            o_fa, o_la = o_fa * a[..., 0, None, None], o_la * a[..., 1, None, None]
        W = o_proj.weight.view(o_proj.out_features, self.n_heads, self.head_dim)  # [C, H, D] (columns by head)
        out = None
        for o, heads, bias in ((o_fa, self.fa_heads, o_proj.bias), (o_la, self.la_heads, None)):
            idx = index_on(heads, W.device)  # [h]
            w = W.index_select(1, idx)  # [C, h, D]
            if self.gamma is not None:  # gamma folded into the columns of each head
                w = w * self.gamma.to(W.dtype)[idx][:, None]
            y = F.linear(o.reshape(B, T, -1), w.reshape(W.shape[0], -1), bias)  # [B, T, C]
            out = y if out is None else out + y
        return out  # [B, T, C]


@torch.no_grad()
def calibrate_fusion(model: nn.Module, teacher: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Set every layer's gamma_h to the teacher's RMS of head h's output (o_proj input) on ``input_ids``.

    After this, a normalised head starts with the teacher head's scale. Returns gamma [L, H]."""
    from headscope.arch import describe
    from headscope.hooks import record_inputs

    arch = describe(teacher)
    with record_inputs(arch.out_projs) as z:  # z[l]  # [B, T, H*D]
        teacher(input_ids=input_ids)
    gammas = []
    for l in range(arch.n_layers):
        zl = z[l].double().reshape(*z[l].shape[:2], arch.n_heads, arch.head_dim)  # [B, T, H, D]
        rms = zl.pow(2).mean(dim=(0, 1, 3)).sqrt()  # [H]
        fusion = model.model.layers[l].self_attn.fusion
        if fusion.gamma is None:
            raise ValueError("calibrate_fusion needs fusion='norm' or 'gated' (fusion='none' has no gamma)")
        fusion.gamma.copy_(rms.to(fusion.gamma))
        gammas.append(rms)
    return torch.stack(gammas)  # [L, H]
