"""The merge of the two branches' head outputs before the (reused) output projection.

(Called "merge" so it is never confused with headscope's score fusion, ``headscope.fuse``, which combines the head
scores of several tasks.)

Modes (``HybridOptions.merge``), registered by name in ``MERGES`` (a new mode is one ``MergeMode`` entry,
``register_merge(...)``, plus a test):
- ``"norm"`` (default, the method's): each head's output is RMS-normalised over its D channels on its
  own, then multiplied by a learnable per-head scale gamma_h (``gamma`` [H], original head order).
- ``"none"``: plain concatenation (the ablation where GDN outputs dwarf FA outputs).
- ``"gated_head"`` (the paper's gated ablation): ``"norm"`` plus a per-position, per-HEAD competition between
  the branches' heads: a = H * softmax(W x + b) over all H heads (``head_gate``, W = 0, b = 0 at init, so
  every a_h = 1); head h is scaled by a_h, so FA and GDN heads compete head by head.
- ``"gated_branch"``: ``"norm"`` plus a per-position competition between the two branches as wholes:
  a = 2 softmax(W x + b) over {FA, GDN} (``branch_gate``, W = 0, b = 0), every FA head scaled by a_FA and
  every GDN head by a_GDN (1 at init). (This was called ``"gated"`` before; ``"gated"`` is now refused with
  a message naming both.)

Heads are put back in their original order, so ``o_proj``'s input columns (ordered by head) are reused
unchanged. ``calibrate_merge`` sets gamma from the teacher's per-head output RMS.

``forward`` is the reference (it builds z [B, T, H*D]); the layer calls ``project``, the same function
followed by ``o_proj`` without building z: each branch is normalised on its own and multiplied by its own
columns of o_proj's weight, with gamma folded into those columns (a [C, H*D] weight instead of a pass over
the [B, T, H, D] activations), so the merge costs one normalisation pass and no copies. It launches more small
kernels than the buffer path, which costs more than the copies below ``PROJECT_MIN_TOKENS`` tokens per call (H200,
docs/hybrid.md: merge + o_proj 0.35 vs 0.21 ms at 4K tokens, 0.58 vs 0.62 ms at 16K, 3.3 vs 4.5 ms at 128K),
so shorter calls (and decoding) keep the buffer path.

A saved hybrid may call it ``fusion`` (the option in its config.json, the module in its weights' names), the older
name: ``HybridOptions.from_dict`` and ``HybridAttention`` read both (``FORMER_NAME``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from headscope.registry import Registry
from hybrid.layers.common import MAX_SLICE_RUNS, NewLinear, acc, call_linear, index_on, mark_new, take_heads

__all__ = ["HeadMerge", "MergeMode", "MERGES", "register_merge", "head_rms", "output_rms", "calibrate_merge",
           "PROJECT_MIN_TOKENS", "FORMER_NAME"]

PROJECT_MIN_TOKENS = 8192  # B*T from which HeadMerge.project skips the z buffer (measured crossover 4K..16K)
FORMER_NAME = "fusion"  # the older name of the option (HybridOptions) and module (HybridAttention)


@dataclass(frozen=True)
class MergeMode:
    """One merge mode: whether heads are RMS-normalised and scaled by gamma, and an optional gate.

    ``gate(merge, hidden)`` builds the gate's new module (a zero-initialised Linear, so the gate starts at
    identity), stored on the HeadMerge as ``gate_name``; ``scales(merge, x)`` maps x [B, T, C] to per-head
    scales [B, T, H] in original head order (1 everywhere at init)."""

    name: str
    description: str
    norm: bool = True
    gate_name: str | None = None
    gate: Callable[["HeadMerge", int], nn.Module] | None = None
    scales: Callable[["HeadMerge", torch.Tensor], torch.Tensor] | None = None
    token_level: bool = False  # usable by the token-level baseline (which has no gate)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"MergeMode.name={self.name!r}: give a non-empty string")
        if (self.gate is None) != (self.scales is None) or (self.gate is None) != (self.gate_name is None):
            raise ValueError(f"MergeMode {self.name!r}: gate, gate_name and scales go together (all or none)")


def _branch_gate(merge: "HeadMerge", hidden: int) -> nn.Module:
    return NewLinear(hidden, 2)  # [FA, GDN] logits


def _branch_scales(merge: "HeadMerge", x: torch.Tensor) -> torch.Tensor:
    """x [B, T, C] -> [B, T, H]: 2 a_FA on FA heads, 2 a_GDN on GDN heads, a = softmax over the 2 branches."""
    a = 2 * torch.softmax(acc(merge.branch_gate(x)), dim=-1).to(x.dtype)  # [B, T, 2]
    if len(merge.runs) > MAX_SLICE_RUNS and not torch.compiler.is_compiling():
        return a.index_select(-1, index_on(merge.branch_of_head, x.device))  # [B, T, H]
    parts = [a[..., (0 if fa else 1):(1 if fa else 2)].expand(*a.shape[:-1], b - s) for fa, s, b in merge.runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)  # [B, T, H]: no index tensor in a compiled graph


def _head_gate(merge: "HeadMerge", hidden: int) -> nn.Module:
    return NewLinear(hidden, merge.n_heads)  # one logit per head, original head order


def _head_scales(merge: "HeadMerge", x: torch.Tensor) -> torch.Tensor:
    """x [B, T, C] -> [B, T, H]: H softmax over all heads of both branches (1 each at init)."""
    return (merge.n_heads * torch.softmax(acc(merge.head_gate(x)), dim=-1)).to(x.dtype)  # [B, T, H]


MERGES: Registry[MergeMode] = Registry("merge mode", owner="hybrid.layers.merge.MERGES")


def register_merge(mode: MergeMode, *, overwrite: bool = False) -> MergeMode:
    """Add ``mode`` to ``MERGES`` (its name becomes a valid ``HybridOptions.merge``); a taken name needs
    ``overwrite=True``."""
    if not isinstance(mode, MergeMode):
        raise TypeError(f"register_merge: give a MergeMode, got {type(mode).__name__}")
    return MERGES.register(mode.name, mode, overwrite=overwrite)


register_merge(MergeMode("norm", "per-head RMSNorm times a learnable per-head gamma (the method's)",
                         token_level=True))
register_merge(MergeMode("none", "plain concatenation (ablation)", norm=False, token_level=True))
register_merge(MergeMode("gated_head", "norm + per-head gated competition: H softmax over all heads (the paper's "
                         "gated ablation)", gate_name="head_gate", gate=_head_gate, scales=_head_scales))
register_merge(MergeMode("gated_branch", "norm + per-branch gate: 2 softmax over {FA, GDN}, shared by a branch's "
                         "heads", gate_name="branch_gate", gate=_branch_gate, scales=_branch_scales))


def head_rms(o: torch.Tensor, eps: float) -> torch.Tensor:
    """o [B, T, H, D] -> o / rms(o) over D, per head (float32 math for half types, input dtype out).

    One fused op (``F.rms_norm`` accumulates half inputs in float32 and rounds once, the same values as
    ``(x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)``)."""
    return F.rms_norm(o, (o.shape[-1],), eps=eps)


def output_rms(z: torch.Tensor) -> torch.Tensor:
    """z [B, T, H, D] (a teacher's per-head attention output) -> each head's RMS over everything  # [H] float64:
    the scale gamma starts at (``calibrate_merge``'s rule)."""
    return z.double().pow(2).mean(dim=(0, 1, 3)).sqrt()


class HeadMerge(nn.Module):
    """Normalise / scale / gate the FA and GDN head outputs and concatenate them in original head order."""

    def __init__(self, hidden: int, n_heads: int, head_dim: int, fa_heads: Sequence[int], mode: str,
                 gamma_init: float = 1.0, eps: float = 1e-6) -> None:
        super().__init__()
        if mode not in MERGES:
            raise ValueError(f"HeadMerge: unknown merge mode {mode!r}; registered: {sorted(MERGES)}")
        self.spec = MERGES[mode]
        self.n_heads, self.head_dim, self.mode, self.eps = n_heads, head_dim, mode, eps
        fa = sorted(fa_heads)
        la = [h for h in range(n_heads) if h not in set(fa)]
        self.fa_heads, self.la_heads = tuple(fa), tuple(la)
        self.branch_of_head = tuple(0 if h in set(fa) else 1 for h in range(n_heads))  # [H]: 0 FA, 1 GDN
        # runs of consecutive heads of one branch, in head order: (is_fa, first, last + 1) in that branch's outputs
        runs, seen = [], [0, 0]
        for h in range(n_heads):
            br = self.branch_of_head[h]
            if runs and runs[-1][0] == (br == 0):
                runs[-1][2] += 1
            else:
                runs.append([br == 0, seen[br], seen[br] + 1])
            seen[br] += 1
        self.runs = tuple(tuple(r) for r in runs)
        self.gamma = nn.Parameter(torch.full((n_heads,), float(gamma_init))) if self.spec.norm else None  # [H]
        self.gate_name = self.spec.gate_name
        if self.spec.gate is not None:
            setattr(self, self.spec.gate_name, self.spec.gate(self, hidden))  # new parameters
            mark_new(getattr(self, self.spec.gate_name))  # also a registered mode's plain nn.Linear
        if self.gamma is not None:
            mark_new(self, "gamma")
        self.gamma_init = float(gamma_init)
        self.project_min_tokens = PROJECT_MIN_TOKENS  # below: project() builds z (fewer kernel launches)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.gamma is not None:
                self.gamma.fill_(self.gamma_init)
        if self.gate_name is not None:  # zero logits: every scale starts at 1
            gate = getattr(self, self.gate_name)
            if isinstance(gate, NewLinear):
                gate.reset_new_parameters()
            else:
                with torch.no_grad():
                    for p in gate.parameters(recurse=False):
                        p.zero_()

    reset_new_parameters = reset_parameters

    def _assemble(self, o_fa: torch.Tensor | None, o_la: torch.Tensor | None) -> torch.Tensor:
        """Both branches' heads in original head order, z [B, T, H, D] (no copy when one branch is absent)."""
        if o_la is None:
            return o_fa  # [B, T, H, D] every head FA, already in order
        if o_fa is None:
            return o_la
        o_la = o_la.to(o_fa.dtype)
        if len(self.runs) <= MAX_SLICE_RUNS or torch.compiler.is_compiling():  # a few runs (e.g. whole KV groups):
            # one cat of slices (one kernel); compiled, always (common.take_heads: no index tensor in the graph)
            parts = [(o_fa if fa else o_la)[:, :, a:b] for fa, a, b in self.runs]  # [B, T, h, D] each
            return torch.cat(parts, 2)  # [B, T, H, D]
        B, T = o_fa.shape[:2]
        z = o_fa.new_empty(B, T, self.n_heads, self.head_dim)  # [B, T, H, D]
        z.index_copy_(2, index_on(self.fa_heads, z.device), o_fa)
        z.index_copy_(2, index_on(self.la_heads, z.device), o_la)
        return z

    def forward(self, x: torch.Tensor, o_fa: torch.Tensor | None, o_la: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, C]; o_fa [B, T, H_F, D]; o_la [B, T, H_L, D] -> z [B, T, H*D] in original head order.

        Heads are first put in order (one preallocated buffer), then normalised and scaled by gamma [H] in one
        pass over all heads (gamma is already in head order: no gather)."""
        z = self._assemble(o_fa, o_la)  # [B, T, H, D]
        if self.spec.norm:
            z = head_rms(z, self.eps) * self.gamma.to(z.dtype)[:, None]  # [B, T, H, D]
        if self.spec.scales is not None and o_fa is not None and o_la is not None:
            z = z * self.spec.scales(self, x).to(z.dtype)[..., None]  # [B, T, H, D]: head h times its scale
        return z.reshape(*z.shape[:2], self.n_heads * self.head_dim)

    def project(self, x: torch.Tensor, o_fa: torch.Tensor | None, o_la: torch.Tensor | None,
                o_proj: nn.Linear) -> torch.Tensor:
        """``o_proj(self(x, o_fa, o_la))`` [B, T, C] without building z (module docstring).

        Falls back to that expression when a branch is absent (nothing to merge), when o_proj carries hooks
        (interventions on o_proj's input, e.g. headscope's ablations, must see z), or below
        ``project_min_tokens`` tokens (B*T) per call, where the buffer path is faster."""
        if (o_fa is None or o_la is None or o_proj._forward_pre_hooks or o_proj._forward_hooks
                or o_fa.shape[0] * o_fa.shape[1] < self.project_min_tokens):
            return call_linear(o_proj, self(x, o_fa, o_la))  # o_proj(...), or the decode GEMV where it is on
        B, T = o_fa.shape[:2]
        o_la = o_la.to(o_fa.dtype)
        if self.spec.norm:
            o_fa, o_la = head_rms(o_fa, self.eps), head_rms(o_la, self.eps)  # [B, T, H_F, D], [B, T, H_L, D]
        if self.spec.scales is not None:
            a = self.spec.scales(self, x).to(o_fa.dtype)  # [B, T, H]
            o_fa = o_fa * take_heads(a, -1, self.fa_heads)[..., None]  # [B, T, H_F, D]
            o_la = o_la * take_heads(a, -1, self.la_heads)[..., None]  # [B, T, H_L, D]
        W = o_proj.weight.view(o_proj.out_features, self.n_heads, self.head_dim)  # [C, H, D] (columns by head)
        out = None
        for o, heads, bias in ((o_fa, self.fa_heads, o_proj.bias), (o_la, self.la_heads, None)):
            w = take_heads(W, 1, heads)  # [C, h, D]
            if self.gamma is not None:  # gamma folded into the columns of each head
                w = w * take_heads(self.gamma.to(W.dtype), 0, heads)[:, None]
            y = F.linear(o.reshape(B, T, -1), w.reshape(W.shape[0], -1), bias)  # [B, T, C]
            out = y if out is None else out + y
        return out  # [B, T, C]


@torch.no_grad()
def calibrate_merge(model: nn.Module, teacher: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Set every layer's gamma_h to the teacher's RMS of head h's output (o_proj input) on ``input_ids``.

    After this, a normalised head starts with the teacher head's scale. The token-level baseline normalises both
    of a head's branches (sliding window, GDN) and sums them: both its ``swa_gamma`` and ``gdn_gamma`` get the
    teacher head's RMS (the same rule: every normalised head output starts at the teacher head's scale). Returns
    gamma [L, H]."""
    from headscope.arch import describe
    from headscope.hooks import record_inputs

    arch = describe(teacher)
    with record_inputs(arch.out_projs) as z:  # z[l]  # [B, T, H*D]
        teacher(input_ids=input_ids)
    gammas = []
    for l in range(arch.n_layers):
        rms = output_rms(z[l].reshape(*z[l].shape[:2], arch.n_heads, arch.head_dim))  # [H]
        attn = model.model.layers[l].self_attn
        if hasattr(attn, "swa_gamma"):  # the token-level baseline (hybrid.layers.token_attention)
            if attn.mode == "none":
                raise ValueError("calibrate_merge: merge='none' has no gamma (the token-level baseline's branches "
                                 "are summed unscaled)")
            attn.swa_gamma.copy_(rms.to(attn.swa_gamma))
            attn.gdn_gamma.copy_(rms.to(attn.gdn_gamma))
            gammas.append(rms)
            continue
        merge = attn.merge
        if merge.gamma is None:
            raise ValueError(f"calibrate_merge needs a merge mode with gamma (one of "
                             f"{sorted(n for n, m in MERGES.items() if m.norm)}); merge='none' has none")
        merge.gamma.copy_(rms.to(merge.gamma))
        gammas.append(rms)
    return torch.stack(gammas)  # [L, H]
