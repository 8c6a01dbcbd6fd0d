"""The registry of training stages: what trains, and the loss of one batch.

    "align"    (stage 1) hybrid; only the new parameters train; per-layer hidden-state MSE vs the teacher
    "distill"  (stage 2) hybrid; everything trains; kl_weight * KL(teacher || student, tau) + ce_weight * CE
    "long"     (stage 3) hybrid; everything trains; next-token CE at >= 4x the stage 1-2 length
    "pretrain"           a fresh (or init_from) model; everything trains; weighted next-token CE

A loss returns terms ``(name, weight, sum, count)``; the trainer divides each sum by its count over all
processes, so a distributed run matches one process on the same global batch. A new stage is one entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from hybrid.train.losses import hidden_mse, kl_div, weighted_ce

__all__ = ["Stage", "STAGES", "register_stage", "Term", "new_parameter_names", "decoder_layers"]

Term = tuple[str, float, torch.Tensor, torch.Tensor]  # (name, weight, sum, count)


@dataclass(frozen=True)
class Stage:
    name: str
    number: int | None  # its place in the three-stage transfer (1, 2, 3), None for "pretrain"
    hybrid: bool  # trains a hybrid built from the teacher and the mask
    uses_teacher: bool  # runs the teacher on every batch
    trains: str  # "new" (only the hybrid's new parameters) or "all"
    loss: Callable[..., list[Term]]  # loss(stage_cfg, student, teacher, ids, w, autocast) -> terms
    doc: str = ""


def new_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters new in the hybrid, as the layers mark them where they create them
    (``HybridForCausalLM.new_parameters``)."""
    m = getattr(model, "module", model)  # DDP
    if hasattr(m, "new_parameters"):
        return set(m.new_parameters())
    return {n for n, p in m.named_parameters() if getattr(p, "_hybrid_new", False)}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    m = getattr(model, "module", model)  # DDP
    return m.model.layers


def _capture(layers: nn.ModuleList, store: list):
    from headscope.hooks import hooks, post

    def fn(module, args, out):
        store.append(out[0] if isinstance(out, tuple) else out)  # [B, T, C]

    return hooks(*(post(layer, fn) for layer in layers))


def _real(ids: torch.Tensor) -> torch.Tensor:
    """attention_mask of ones: every token of a training row is real text (rows are packed with EOS, which is
    also the pad id of many tokenizers; the hybrid would refuse unmasked rows that look padded)."""
    return torch.ones_like(ids)


def align_loss(cfg, student, teacher, ids, w, autocast) -> list[Term]:
    s_h: list = []
    t_h: list = []
    with torch.no_grad(), autocast, _capture(decoder_layers(teacher), t_h):
        teacher(input_ids=ids, attention_mask=_real(ids), logits_to_keep=1)  # the root module (FSDP); 1 logit row
    with autocast, _capture(decoder_layers(student), s_h):
        student(input_ids=ids, attention_mask=_real(ids), logits_to_keep=1)  # [B, 1, V]: DDP's forward, no logits
    total, count = hidden_mse(s_h, t_h)
    return [("mse", 1.0, total, count)]


def distill_loss(cfg, student, teacher, ids, w, autocast) -> list[Term]:
    with torch.no_grad(), autocast:
        t_logits = teacher(input_ids=ids, attention_mask=_real(ids)).logits  # [B, T, V]
    with autocast:
        s_logits = student(input_ids=ids, attention_mask=_real(ids)).logits  # [B, T, V]
    terms = []
    if cfg.kl_weight:
        terms.append(("kl", cfg.kl_weight, *kl_div(s_logits, t_logits, cfg.temperature)))
    if cfg.ce_weight:
        terms.append(("ce", cfg.ce_weight, *weighted_ce(s_logits, ids, w)))
    return terms


def lm_loss(cfg, student, teacher, ids, w, autocast) -> list[Term]:
    with autocast:
        logits = student(input_ids=ids, attention_mask=_real(ids)).logits  # [B, T, V]
    return [("ce", 1.0, *weighted_ce(logits, ids, w))]


STAGES: dict[str, Stage] = {}


def register_stage(stage: Stage) -> None:
    if stage.trains not in ("new", "all"):
        raise ValueError(f"Stage {stage.name!r}: trains={stage.trains!r} must be 'new' or 'all'")
    STAGES[stage.name] = stage


register_stage(Stage("align", 1, True, True, "new", align_loss, "hidden-state MSE per layer, new parameters only"))
register_stage(Stage("distill", 2, True, True, "all", distill_loss, "KL(teacher || student) + CE, all parameters"))
register_stage(Stage("long", 3, True, False, "all", lm_loss, "next-token CE at a longer context"))
register_stage(Stage("pretrain", None, False, False, "all", lm_loss, "weighted next-token CE (reference model)"))
