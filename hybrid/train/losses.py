"""Training losses, each as ``(sum, count)`` so a distributed run can divide by the global count and match
one process on the same global batch exactly (``Trainer`` all-reduces the counts).

- ``weighted_ce``: next-token cross-entropy with per-token weights ``w`` (answer positions weighted up);
- ``kl_div``: KL(teacher || student) of next-token distributions at temperature tau, times tau^2;
- ``hidden_mse``: the per-layer hidden-state MSE against the teacher, summed over layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["weighted_ce", "kl_div", "hidden_mse", "row_ce"]


def _f32(x: torch.Tensor) -> torch.Tensor:
    """float32 math (half and float32 logits), float64 kept (the fused twin's float64 tests compare tightly)."""
    return x if x.dtype == torch.float64 else x.float()


def weighted_ce(logits: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, T, V], ids [B, T], w [B, T] (weight of the target ids[:, t+1] at t) -> (sum w*ce, sum w)."""
    B, T, V = logits.shape
    ce = F.cross_entropy(_f32(logits[:, :-1]).reshape(-1, V), ids[:, 1:].reshape(-1),
                         reduction="none").view(B, T - 1)  # [B, T-1]
    ww = w[:, :-1].to(ce.dtype)  # [B, T-1]
    return (ce * ww).sum(), ww.sum()


@torch.no_grad()
def row_ce(logits: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-row mean unweighted CE on the positions with weight > 0: ``[B]`` (for per-kind logging)."""
    B, T, V = logits.shape
    ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1),
                         reduction="none").view(B, T - 1)  # [B, T-1]
    m = (w[:, :-1] > 0).to(ce.dtype)  # [B, T-1]
    return (ce * m).sum(1) / m.sum(1).clamp_min(1)


def kl_div(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sum over positions of tau^2 * KL(softmax(t / tau) || softmax(s / tau)), and the number of positions.

    student_logits, teacher_logits [B, T, V]; mask [B, T] (1 = counted; default all)."""
    s = F.log_softmax(_f32(student_logits) / temperature, -1)  # [B, T, V]
    t = F.log_softmax(_f32(teacher_logits) / temperature, -1)  # [B, T, V]
    kl = (t.exp() * (t - s)).sum(-1) * temperature ** 2  # [B, T]
    if mask is None:
        return kl.sum(), torch.tensor(float(kl.numel()), device=kl.device)
    m = mask.to(kl.dtype)
    return (kl * m).sum(), m.sum()


def hidden_mse(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over layers of the mean squared error per position: (sum over layers, positions and channels of
    (s - t)^2 / C, number of positions). Each list holds one ``[B, T, C]`` per layer."""
    if len(student) != len(teacher) or not student:
        raise ValueError(f"hidden_mse: {len(student)} student layers vs {len(teacher)} teacher layers")
    total = 0.0
    for s, t in zip(student, teacher):
        total = total + (s.float() - t.float()).pow(2).mean(-1).sum()  # sum over B, T of mean over C
    B, T, _ = student[0].shape
    return total, torch.tensor(float(B * T), device=student[0].device)
