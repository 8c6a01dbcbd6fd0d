"""The registry of training stages: what trains, and the loss of one batch.

    "align"    (stage 1) hybrid; the new parameters train, and the GDN heads' reused q/k/v unless the stage's
               train_gdn_qkv is false; per-layer hidden-state MSE vs the teacher, the hybrid run end to end or
               (align_inputs = "teacher") each layer fed the teacher's input to it
    "distill"  (stage 2) hybrid; everything trains; kl_weight * KL(teacher || student, tau) + ce_weight * CE
    "distill_on_policy" (stage 2, on the student's own text) as "distill", but the last on_policy_tokens of each
               row are the student's continuation of the rest (sampled without gradient): the KL counts on every
               position, the CE on the corpus part only
    "long"     (stage 3) hybrid; everything trains; next-token CE at >= 4x the stage 1-2 length
    "long_distill" (stage 3) as "long", plus kl_weight * KL(teacher || student) on each row's first kl_positions
               positions (0: the teacher's max_position_embeddings), the teacher run on those alone; the CE
               (ce_weight) on every position
    "pretrain"           a fresh (or init_from) model; everything trains; weighted next-token CE

A loss returns terms ``(name, weight, sum, count)``; the trainer divides each sum by its count over all
processes, so a distributed run matches one process on the same global batch; a stage's ``counts`` gives the same
counts from the batch alone, so a batch split into passes (``micro_batch_size``) matches one pass. A new stage is
one entry.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from headscope.registry import Registry
from hybrid.train.errors import TrainConfigError
from hybrid.train.losses import hidden_mse, kl_div, weighted_ce

__all__ = ["Stage", "STAGES", "register_stage", "Term", "new_parameter_names", "gdn_qkv_parameter_names",
           "fa_qk_parameter_names",
           "decoder_layers", "FUSED_LOSS", "use_fused_loss", "final_hidden"]

Term = tuple[str, float, torch.Tensor, torch.Tensor]  # (name, weight, sum, count)


@dataclass(frozen=True)
class Stage:
    name: str
    number: int | None  # its place in the three-stage transfer (1, 2, 3), None for "pretrain"
    hybrid: bool  # trains a hybrid built from the teacher and the mask
    uses_teacher: bool  # runs the teacher on every batch
    trains: str  # "new" (the hybrid's new parameters; + the GDN q/k/v with train_gdn_qkv) or "all"
    loss: Callable[..., list[Term]]  # loss(stage_cfg, student, teacher, ids, w, autocast) -> terms
    doc: str = ""
    # counts(stage_cfg, ids, w) -> the loss's term counts, in its order, without running a model; lets the trainer
    # split a step's batch into passes (StageConfig.micro_batch_size) and still divide by the whole batch's counts.
    # None: the stage cannot (micro_batch_size refused)
    counts: Callable[..., list[torch.Tensor]] | None = None
    # for_teacher(stage_cfg, teacher) -> the stage_cfg the loss and counts get, its defaults that depend on the
    # teacher filled in (long_distill: kl_positions = 0 -> the teacher's positions); the trainer applies it at the
    # stage's start. None: the stage_cfg as given
    for_teacher: Callable[..., object] | None = None


def transfer_lengths(stages) -> list[int]:
    """The ``seq_len`` of each stage-1 or stage-2 stage (align, distill, distill_on_policy) of a run's stages."""
    return [s.seq_len for s in stages if STAGES[s.name].number in (1, 2)]


def new_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters new in the hybrid, as the layers mark them where they create them
    (``HybridForCausalLM.new_parameters``)."""
    m = getattr(model, "module", model)  # DDP
    if hasattr(m, "new_parameters"):
        return set(m.new_parameters())
    return {n for n, p in m.named_parameters() if getattr(p, "_hybrid_new", False)}


def _reused_parameter_names(model: nn.Module, branch: type, parts: tuple[str, ...]) -> set[str]:
    """Names of the parameters of each ``branch`` module's ``parts`` (sub-modules; those a branch lacks skipped)."""
    m = getattr(model, "module", model)  # DDP
    out = set()
    for name, module in m.named_modules():
        if isinstance(module, branch):
            for part in parts:
                sub = getattr(module, part, None)
                if sub is not None:
                    out |= {f"{name}.{part}.{p}" for p, _ in sub.named_parameters()}
    return out


def fa_qk_parameter_names(model: nn.Module) -> set[str]:
    """Names of the FA heads' reused query/key parameters: each full-attention branch's q/k projections (weights and
    biases) and q/k norms, copied from the teacher by the conversion. Without RoPE (``fa_rope=False``) they are the
    parts whose use changes: "align" trains them with ``train_fa_qk``."""
    from hybrid.layers.hybrid_attention import FullAttentionBranch

    return _reused_parameter_names(model, FullAttentionBranch, ("q_proj", "k_proj", "q_norm", "k_norm"))


def gdn_qkv_parameter_names(model: nn.Module) -> set[str]:
    """Names of the GDN heads' reused query/key/value parameters: each Gated DeltaNet branch's q/k/v projections
    (weights and biases) and its q/k norms, copied from the teacher by the conversion (the branch's new beta / decay
    parameters and convolutions are ``new_parameter_names``'). "align" trains them with ``train_gdn_qkv``."""
    from hybrid.layers.hybrid_attention import GatedDeltaNetBranch

    return _reused_parameter_names(model, GatedDeltaNetBranch, ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"))


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


def _record_inputs(layers: nn.ModuleList, store: list):
    """Each layer's input hidden state, in layer order, appended to ``store`` while the block runs: the tensors
    themselves (the layer below's outputs, kept anyway), not ``headscope.hooks.record_inputs``' copies, through one
    hook function for every layer (a compiled teacher's layers share their code)."""
    from headscope.hooks import hooks, pre

    def fn(module, args, kwargs):
        store.append(args[0] if args else kwargs["hidden_states"])  # [B, T, C]

    return hooks(*(pre(layer, fn, with_kwargs=True) for layer in layers))


def _feed_inputs(layers: nn.ModuleList, inputs: list):
    """Each layer reads the next of ``inputs`` (detached: no gradient between layers) in place of the layer below's
    output; layers run in order, so layer l reads ``inputs[l]``. One hook function for every layer, run outside
    torch.compile (a compiled layer would otherwise recompile for each layer's own hook)."""
    from collections import deque

    from headscope.hooks import hooks, pre

    queue = deque(inputs)

    @torch.compiler.disable
    def fn(module, args, kwargs):
        given = args[0] if args else kwargs["hidden_states"]  # [B, T, C]
        x = queue.popleft().detach()  # [B, T, C]
        if x.shape != given.shape:
            raise ValueError(f"align_inputs = 'teacher': a student layer reads {tuple(given.shape)}, the teacher's "
                             f"input to it is {tuple(x.shape)}; the two models' hidden sizes must match")
        x = x.to(given.dtype)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    return hooks(*(pre(layer, fn, with_kwargs=True) for layer in layers))


def align_loss(cfg, student, teacher, ids, w, autocast) -> list[Term]:
    """Sum over layers of the per-position hidden-state MSE against the teacher. ``cfg.align_inputs`` "student":
    the hybrid runs end to end; "teacher": each student layer reads the teacher's input to that layer."""
    s_h: list = []
    t_h: list = []
    t_in: list = []
    forced = cfg.align_inputs == "teacher"
    t_layers, s_layers = decoder_layers(teacher), decoder_layers(student)
    with torch.no_grad(), autocast, _capture(t_layers, t_h), _record_inputs(t_layers if forced else [], t_in):
        # the root module (FSDP); 1 logit row; no cache in training (a HybridCache would keep every K/V and GDN state)
        teacher(input_ids=ids, attention_mask=_real(ids), use_cache=False, logits_to_keep=1)
    if forced and len(t_in) != len(s_layers):
        raise ValueError(f"align_inputs = 'teacher': the teacher's {len(t_in)} decoder layers ran, the student has "
                         f"{len(s_layers)}; teacher-fed alignment needs one teacher layer per student layer")
    with autocast, _capture(s_layers, s_h), _feed_inputs(s_layers if forced else [], t_in):
        student(input_ids=ids, attention_mask=_real(ids), use_cache=False, logits_to_keep=1)  # [B, 1, V]: DDP's forward
    total, count = hidden_mse(s_h, t_h)
    return [("mse", 1.0, total, count)]


def _fused_terms(cfg, student, teacher, ids, w, autocast) -> list[Term] | None:
    """The distill terms by the fused loss where the stage's ``fused_loss`` and the models allow it, else None."""
    if use_fused_loss(cfg, student, teacher if cfg.kl_weight else None, ids):
        try:
            return _distill_fused(cfg, student, teacher, ids, w, autocast)
        except FusedLossMismatch as err:  # "auto": warn once and keep training on the naive path
            if cfg.fused_loss == "on":
                raise
            import warnings

            warnings.warn(f"{err}; stage '{cfg.name}' continues with the naive loss (full logits)", stacklevel=2)
            _FUSED_OFF.add(getattr(student, "module", student))
    return None


def distill_loss(cfg, student, teacher, ids, w, autocast, kl_parts=()) -> list[Term]:
    """kl_weight * KL over every position + ce_weight * CE weighted by ``w`` (the fused loss where it runs, else
    from the full logits). ``kl_parts``: (name, mask [B, T]) pairs whose KL is logged too, with weight 0, on the
    full-logits path only."""
    fused = _fused_terms(cfg, student, teacher, ids, w, autocast)
    if fused is not None:
        return fused
    with torch.no_grad(), autocast:
        t_logits = teacher(input_ids=ids, attention_mask=_real(ids), use_cache=False).logits  # [B, T, V]
    with autocast:
        s_logits = student(input_ids=ids, attention_mask=_real(ids), use_cache=False).logits  # [B, T, V]
    terms = []
    if cfg.kl_weight:
        terms.append(("kl", cfg.kl_weight, *kl_div(s_logits, t_logits, cfg.temperature)))
    with torch.no_grad():
        for name, mask in kl_parts:
            terms.append((name, 0.0, *kl_div(s_logits.detach(), t_logits, cfg.temperature, mask)))
    if cfg.ce_weight:
        terms.append(("ce", cfg.ce_weight, *weighted_ce(s_logits, ids, w)))
    return terms


def _sample_seed(ids: torch.Tensor) -> int:
    """A sampling seed that is a function of the batch: a resumed run samples the same continuations."""
    head = ids[:, : min(ids.shape[1], 32)].long()  # [B, <=32]
    weights = torch.arange(1, head.numel() + 1, device=ids.device).view_as(head)
    return int((head * weights).sum().item()) % (2**31 - 1)


@torch.no_grad()
def student_continuation(cfg, student, prompt: torch.Tensor, autocast) -> torch.Tensor:
    """The student's own ``cfg.on_policy_tokens`` tokens after each row of ``prompt`` [B, P] -> [B, G], sampled
    at ``cfg.sample_temperature`` (0: greedy) on the static-cache decode path, in eval mode, without gradient."""
    from hybrid.decoding import sample_decode

    m = getattr(student, "module", student)  # DDP
    if not hasattr(m, "config") or not hasattr(m, "model"):
        raise TypeError(f"stage '{cfg.name}': the student must be a hybrid model that decodes (got "
                        f"{type(m).__name__}); FSDP-sharded students cannot generate here: use distributed = "
                        "'ddp' or one process")
    was = m.training
    m.eval()
    try:
        gen = torch.Generator(device=prompt.device).manual_seed(_sample_seed(prompt))
        with autocast:
            # on CUDA the step is captured as a CUDA graph for this batch (the weights change every step)
            tokens, _ = sample_decode(m, list(prompt), cfg.on_policy_tokens, temperature=cfg.sample_temperature,
                                      generator=gen)  # [B, G]
    finally:
        m.train(was)
    return tokens.to(prompt.dtype)


def _corpus_weights(cfg, w: torch.Tensor) -> torch.Tensor:
    """w [B, T] with the positions predicting the student's own tokens zeroed (w[t] weighs the target t + 1)."""
    w_corpus = w.clone()  # [B, T]
    w_corpus[:, w.shape[1] - cfg.on_policy_tokens - 1:] = 0
    return w_corpus


def on_policy_loss(cfg, student, teacher, ids, w, autocast) -> list[Term]:
    """distill_loss on each row's first T - on_policy_tokens tokens followed by the student's own continuation:
    the KL over every position, the CE on the corpus part. Logged besides, with weight 0, on the full-logits path
    of a step in one pass: the KL on the student's own tokens and on the rest (a step split into passes,
    ``micro_batch_size``, gives the terms its counts() names, which are the distill terms alone)."""
    B, T = ids.shape
    P = T - cfg.on_policy_tokens
    seq = torch.cat([ids[:, :P], student_continuation(cfg, student, ids[:, :P], autocast)], 1)  # [B, T]
    own = torch.zeros(B, T, dtype=torch.bool, device=ids.device)  # [B, T]: positions predicting the student's tokens
    own[:, P - 1:] = True
    parts = () if cfg.micro_batch_size else (("kl_own", own), ("kl_corpus", ~own))
    return distill_loss(cfg, student, teacher, seq, _corpus_weights(cfg, w), autocast, kl_parts=parts)


# ---- the fused loss (hybrid.train.fused_loss): lm_head + KL + CE in chunks, no [B, T, V] logits -------------------
FUSED_LOSS = ("auto", "on", "off")  # StageConfig.fused_loss
AUTO_DEVICES = ("cuda",)  # where "auto" fuses (CPU keeps the naive path: its bit-identity tests)
_HEAD_CHECKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models whose final hidden state was checked
_FUSED_OFF: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # students whose check failed under "auto"


class FusedLossMismatch(RuntimeError):
    """A model's hidden_states[-1] is not its lm_head's input (another transformers version, a logit scale)."""


def _fused_refusal(model: nn.Module) -> str | None:
    """Why the fused loss cannot run on ``model`` (None: it can)."""
    m = getattr(model, "module", model)  # DDP
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # an old torch without FSDP2
        FSDPModule = ()
    if isinstance(m, FSDPModule):
        return "FSDP shards the lm_head weight, which the fused loss needs whole (the naive path runs under FSDP)"
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return f"{type(m).__name__} has no nn.Linear lm_head (get_output_embeddings)"
    if head.bias is not None:
        return f"{type(m).__name__}'s lm_head has a bias, which the fused loss does not add"
    return None


def use_fused_loss(cfg, student, teacher, ids: torch.Tensor) -> bool:
    """``cfg.fused_loss``: "on" (refused where it cannot run), "off", or "auto" = on for a CUDA batch when the
    student and the teacher (None: not used) allow it (not FSDP, a bias-free nn.Linear lm_head)."""
    mode = getattr(cfg, "fused_loss", "off")
    if mode == "off" or (mode == "auto" and getattr(student, "module", student) in _FUSED_OFF):
        return False
    why = _fused_refusal(student) or (_fused_refusal(teacher) if teacher is not None else None)
    if mode == "on" and why is not None:
        raise ValueError(f"stages[{cfg.name}].fused_loss='on': {why}; use fused_loss='auto' or 'off'")
    return why is None and (mode == "on" or ids.device.type in AUTO_DEVICES)


def final_hidden(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the final post-norm hidden state [B, T, C], the lm_head weight [V, C]) of ``model`` on ``ids``, without
    the [B, T, V] logits. The wrapped model's forward runs (DDP's, whose gradient hooks must fire); one logit row
    is computed, and on a model's first call compared with lm_head(hidden[:, -1]): transformers 5 ties
    hidden_states[-1] to the post-norm last_hidden_state (HF Llama / Qwen3), and HybridModel returns the normed
    state last; a model that did otherwise (a pre-norm state, a logit scale or soft-cap) is refused here."""
    m = getattr(model, "module", model)  # DDP
    # -1: only the last hidden state is kept by transformers' output capture; the hybrid returns all, as for True
    out = model(input_ids=ids, attention_mask=_real(ids), use_cache=False, logits_to_keep=1, output_hidden_states=-1)
    h = out.hidden_states[-1]  # [B, T, C]
    weight = m.get_output_embeddings().weight  # [V, C]
    if m not in _HEAD_CHECKED:
        with torch.no_grad():
            ref = out.logits[:, -1].float()  # [B, V]
            mine = F.linear(h[:, -1], weight).float()  # [B, V]
            err = float((mine - ref).norm() / ref.norm().clamp_min(1e-30))
        if not (h.shape[:2] == ids.shape and err < 1e-2):
            raise FusedLossMismatch(f"fused_loss: {type(m).__name__}'s hidden_states[-1] {tuple(h.shape)} is not the "
                               f"lm_head's input (relative error {err:.2e} of the last logits); set the stage's "
                               "fused_loss='off'")
        _HEAD_CHECKED.add(m)
    return h, weight


def _distill_fused(cfg, student, teacher, ids, w, autocast) -> list[Term]:
    from hybrid.train.fused_loss import fused_distill_loss

    h_t = w_t = None
    if cfg.kl_weight:
        with torch.no_grad(), autocast:
            h_t, w_t = final_hidden(teacher, ids)  # [B, T, Ct], [V, Ct]
    with autocast:
        h_s, w_s = final_hidden(student, ids)  # [B, T, C], [V, C]
        terms = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, temperature=cfg.temperature,
                                   kl=bool(cfg.kl_weight), ce=bool(cfg.ce_weight))
    weights = {"kl": cfg.kl_weight, "ce": cfg.ce_weight}
    return [(name, weights[name], total, count) for name, (total, count) in terms.items()]


def lm_loss(cfg, student, teacher, ids, w, autocast) -> list[Term]:
    with autocast:
        logits = student(input_ids=ids, attention_mask=_real(ids), use_cache=False).logits  # [B, T, V]
    return [("ce", 1.0, *weighted_ce(logits, ids, w))]


def teacher_positions(teacher: nn.Module) -> int:
    """The positions the teacher was trained on: its config's ``max_position_embeddings`` (``n_positions``)."""
    from headscope.evaluate.lengths import configured_positions

    m = getattr(teacher, "module", teacher)  # DDP
    n = configured_positions(m)
    if n is None:
        raise ValueError(f"{type(m).__name__} has no config.max_position_embeddings; give the stage's "
                         "kl_positions (the positions where the teacher's KL counts)")
    return n


def kl_positions(cfg, teacher: nn.Module) -> int:
    """long_distill's P: ``cfg.kl_positions``, or (0) the teacher's positions; refused past them (the teacher
    never runs where its positions do not hold)."""
    limit = teacher_positions(teacher)
    if cfg.kl_positions > limit:
        raise TrainConfigError(f"stages[{cfg.name}].kl_positions={cfg.kl_positions}: the teacher has {limit} "
                               f"positions and must not run past them; give kl_positions <= {limit} (0: {limit})")
    return cfg.kl_positions or limit


def with_kl_positions(cfg, teacher: nn.Module):
    """``cfg`` with ``kl_positions`` = P (``kl_positions``; a teacher is needed only when the KL counts)."""
    import dataclasses

    if not cfg.kl_weight or teacher is None:
        return cfg
    return dataclasses.replace(cfg, kl_positions=kl_positions(cfg, teacher))


def long_distill_loss(cfg, student, teacher, ids, w, autocast) -> list[Term]:
    """kl_weight * KL(teacher || student) over each row's first P positions (``kl_positions``; the teacher runs on
    ``ids[:, :P]`` alone, inside its positions) + ce_weight * CE weighted by ``w`` over every position, from the
    full logits. The student's logits at t < P read tokens <= t only, so they match the teacher's on the prefix.
    P >= T: distill's naive loss."""
    B, T = ids.shape
    terms = []
    if cfg.kl_weight:
        P = min(T, kl_positions(cfg, teacher))
        head = ids[:, :P]  # [B, P]
        with torch.no_grad(), autocast:
            t_logits = teacher(input_ids=head, attention_mask=_real(head), use_cache=False).logits  # [B, P, V]
    with autocast:
        s_logits = student(input_ids=ids, attention_mask=_real(ids), use_cache=False).logits  # [B, T, V]
    if cfg.kl_weight:
        terms.append(("kl", cfg.kl_weight, *kl_div(s_logits[:, :P], t_logits, cfg.temperature)))  # [B, P, V] each
    if cfg.ce_weight:
        terms.append(("ce", cfg.ce_weight, *weighted_ce(s_logits, ids, w)))
    return terms


def long_distill_counts(cfg, ids, w) -> list[torch.Tensor]:
    """long_distill_loss's counts: the KL over the first P positions of each row (B * min(P, T); P as
    ``with_kl_positions`` gives it), the CE weighted by ``w``."""
    out = []
    if cfg.kl_weight:
        if cfg.kl_positions < 1:
            raise ValueError(f"stage {cfg.name!r}: kl_positions=0 is the teacher's positions, which the counts "
                             "cannot see; pass the stage config through hybrid.train.stages.with_kl_positions first")
        B, T = ids.shape
        out.append(torch.tensor(float(B * min(T, cfg.kl_positions)), device=ids.device))
    if cfg.ce_weight:
        out.append(w[:, :-1].float().sum())
    return out


def position_counts(cfg, ids, w) -> list[torch.Tensor]:
    """align_loss's count: every position of every row (hidden_mse's B * T)."""
    return [torch.tensor(float(ids.numel()), device=ids.device)]


def distill_counts(cfg, ids, w) -> list[torch.Tensor]:
    """distill_loss's counts, fused or naive: the KL over every position (B * T), the CE weighted by ``w``."""
    out = []
    if cfg.kl_weight:
        out.append(torch.tensor(float(ids.numel()), device=ids.device))
    if cfg.ce_weight:
        out.append(w[:, :-1].float().sum())
    return out


def on_policy_counts(cfg, ids, w) -> list[torch.Tensor]:
    """on_policy_loss's counts in passes (no logged parts): the KL over every position, the CE on the corpus part.
    The student's continuation replaces tokens, not positions or weights, so the counts need no sampling."""
    return distill_counts(cfg, ids, _corpus_weights(cfg, w))


def ce_counts(cfg, ids, w) -> list[torch.Tensor]:
    """lm_loss's count: the weights of the targets (weighted_ce)."""
    return [w[:, :-1].float().sum()]


STAGES: Registry[Stage] = Registry("training stage", owner="hybrid.train.STAGES")


def register_stage(stage: Stage, *, overwrite: bool = False) -> None:
    """Make ``stage.name`` usable in a run's ``[[stages]]``; a taken name needs ``overwrite=True``."""
    if stage.trains not in ("new", "all"):
        raise ValueError(f"Stage {stage.name!r}: trains={stage.trains!r} must be 'new' or 'all'")
    STAGES.register(stage.name, stage, overwrite=overwrite)


register_stage(Stage("align", 1, True, True, "new", align_loss, "hidden-state MSE per layer, new parameters only",
                     position_counts))
register_stage(Stage("distill", 2, True, True, "all", distill_loss, "KL(teacher || student) + CE, all parameters",
                     distill_counts))
register_stage(Stage("distill_on_policy", 2, True, True, "all", on_policy_loss,
                     "KL(teacher || student) on rows the student continues itself + CE on the corpus part",
                     on_policy_counts))
register_stage(Stage("long", 3, True, False, "all", lm_loss, "next-token CE at a longer context", ce_counts))
register_stage(Stage("long_distill", 3, True, True, "all", long_distill_loss,
                     "KL(teacher || student) within the teacher's positions + CE on every position, at a longer "
                     "context", long_distill_counts, with_kl_positions))
register_stage(Stage("pretrain", None, False, False, "all", lm_loss, "weighted next-token CE (reference model)",
                     ce_counts))
