"""Build a hybrid from a full-attention teacher and a head mask: ``from_mask(teacher, mask, **options)``.

Parameter reuse (docs/method.md section 2), per layer with D = head_dim and rep = H / K (GQA group):
- FA branch: q rows of the FA heads; k/v rows of the KV heads those FA heads read (only those);
- GDN branch: q rows of the GDN heads; for each GDN head h, the k/v rows of its KV head h // rep
  (GQA -> MHA: the KV head is repeated once per query head);
- q_norm / k_norm (Qwen3) copied into both branches; o_proj copied unchanged (its input columns are
  ordered by head, and the merge concatenates heads in the original order);
- embeddings, RMSNorms, MLPs, lm_head copied.
New parameters get the init documented in docs/hybrid.md (``reset_new_parameters``).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from hybrid.config import HybridConfig, HybridConfigError, HybridOptions
from hybrid.modeling import HybridForCausalLM, register

__all__ = ["from_mask", "hybrid_config"]


def _teacher_parts(teacher: nn.Module):
    layers = getattr(getattr(teacher, "model", None), "layers", None)
    ok = layers is not None and hasattr(teacher, "lm_head") and all(
        hasattr(l, "self_attn") and hasattr(l, "mlp") and all(hasattr(l.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        and all(hasattr(l.mlp, p) for p in ("gate_proj", "up_proj", "down_proj")) for l in layers)
    if not ok:
        raise HybridConfigError(
            f"from_mask needs a Llama-shaped causal LM (model.layers[i].self_attn.q/k/v/o_proj, mlp.gate/up/down_proj, "
            f"lm_head): Qwen3, Llama, Qwen2, Mistral; got {type(teacher).__name__}")
    return layers


def hybrid_config(teacher: nn.Module, fa_heads: list[list[int]], options: HybridOptions) -> HybridConfig:
    """The HybridConfig of ``teacher`` with FA heads ``fa_heads[l]`` and ``options``."""
    layers = _teacher_parts(teacher)
    tc = teacher.config
    attn, mlp = layers[0].self_attn, layers[0].mlp
    H = tc.num_attention_heads
    D = getattr(tc, "head_dim", None) or tc.hidden_size // H
    if attn.q_proj.out_features != H * D:
        raise HybridConfigError(f"teacher q_proj has {attn.q_proj.out_features} outputs, expected H*D = {H}*{D}")
    return HybridConfig(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_hidden_layers, num_attention_heads=H,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or H, head_dim=D, hidden_act=tc.hidden_act,
        rms_norm_eps=tc.rms_norm_eps, max_position_embeddings=tc.max_position_embeddings,
        rope_parameters=dict(tc.rope_parameters), qk_norm=hasattr(attn, "q_norm"),
        qkv_bias=attn.q_proj.bias is not None, o_bias=attn.o_proj.bias is not None,
        mlp_bias=mlp.gate_proj.bias is not None, initializer_range=getattr(tc, "initializer_range", 0.02),
        base_model_type=tc.model_type, fa_heads=fa_heads, hybrid=options.to_dict(),
        tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)),
        pad_token_id=getattr(tc, "pad_token_id", None), bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=getattr(tc, "eos_token_id", None))


def _rows(linear: nn.Linear, heads: list[int], D: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of ``linear`` belonging to ``heads`` (D rows each), in the order given: W [h*D, C], b [h*D]."""
    W = linear.weight.detach().view(-1, D, linear.in_features)  # [n, D, C]
    idx = torch.tensor(heads, dtype=torch.long, device=W.device)
    b = linear.bias.detach().view(-1, D)[idx].reshape(-1) if linear.bias is not None else None
    return W[idx].reshape(-1, linear.in_features), b


def _load(dst: nn.Linear, W: torch.Tensor, b: torch.Tensor | None) -> None:
    if dst.weight.shape != W.shape:
        raise HybridConfigError(f"internal: weight shape {tuple(W.shape)} != {tuple(dst.weight.shape)}")
    dst.weight.copy_(W)
    if dst.bias is not None:
        dst.bias.copy_(b if b is not None else torch.zeros_like(dst.bias))


def _copy_branch(branch: nn.Module, t_attn: nn.Module, q_heads: list[int], kv_heads: list[int], D: int) -> None:
    _load(branch.q_proj, *_rows(t_attn.q_proj, q_heads, D))
    _load(branch.k_proj, *_rows(t_attn.k_proj, kv_heads, D))
    _load(branch.v_proj, *_rows(t_attn.v_proj, kv_heads, D))
    if branch.q_norm is not None:
        branch.q_norm.weight.copy_(t_attn.q_norm.weight)
        branch.k_norm.weight.copy_(t_attn.k_norm.weight)


def rope_mean_rotation(inv_freq: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``inv_freq  # [D/2]`` -> (E cos(d w), E sin(d w)), each ``[D/2]`` float64: the mean over every causal
    (query, key) pair of a ``length``-token context, i.e. over the distance d = 0 .. length-1 weighted by the
    length - d pairs at that distance."""
    d = torch.arange(length, dtype=torch.float64)  # [length]
    w = (length - d) / (length - d).sum()  # [length]
    ang = d[:, None] * inv_freq.double()[None, :]  # [length, D/2]
    return (w[:, None] * ang.cos()).sum(0), (w[:, None] * ang.sin()).sum(0)


@torch.no_grad()
def rope_mean_queries(branch: nn.Module, rotary: nn.Module, length: int) -> None:
    """A NoPE FA branch's query rows mapped so that its logit q'.k is the teacher's RoPE logit averaged over the
    causal pairs of ``length`` tokens: per head and rotary pair (a, b) = (i, i + D/2), the teacher's logit at
    distance d is q^T R(-d w_i) k (HF's rotate-half convention), so q' = E[R(-d w_i)]^T q = [[c, -s], [s, c]] q with
    (c, s) = ``rope_mean_rotation`` (times RoPE's attention scaling squared). Low frequencies (wavelength past the
    context) keep their rows, high ones, whose rotation averages out, shrink towards 0. The keys are left as they are
    (one per KV group, shared with the group's other heads)."""
    if getattr(branch, "q_norm", None) is not None:
        raise ValueError("fa_nope_init='rope_mean' maps the query projection's rows, which a per-head q_norm after "
                         "the projection would undo: this teacher has q/k norms; use fa_nope_init='copy'")
    inv_freq, scaling = rotary.inv_freq()  # [D/2]
    c, s = (x * scaling ** 2 for x in rope_mean_rotation(inv_freq, length))  # [D/2] each
    half = inv_freq.numel()
    for p in (branch.q_proj.weight, branch.q_proj.bias):
        if p is None:
            continue
        w = p.view(-1, 2, half, *p.shape[1:]).double()  # [H, 2, D/2, (hidden)]
        shape = (half,) + (1,) * (w.dim() - 3)  # broadcast over the hidden dim (weights) or none (bias)
        cc, ss = c.view(shape), s.view(shape)
        a, b = w[:, 0], w[:, 1]  # [H, D/2, (hidden)] each
        p.copy_(torch.stack((cc * a - ss * b, ss * a + cc * b), 1).reshape(p.shape).to(p.dtype))


@torch.no_grad()
def from_mask(teacher: nn.Module, mask: Any, *, check_fingerprint: bool = True, **options: Any) -> HybridForCausalLM:
    """A HybridForCausalLM whose FA heads are ``mask``'s (a HeadMask or the path to its JSON).

    ``options`` are HybridOptions fields (granularity, fa_rope, fa_log_scale, log_scale_base, fa_gate,
    gdn_conv, decay, merge, gamma_init, window, require_fa_per_layer, allow_degenerate, seed, backends).
    The mask is recorded in the hybrid's config (``config.head_mask``, ``HeadMask.to_dict()``: heads, fingerprint),
    so a saved hybrid carries it: ``HeadMask.from_dict(hybrid.load(path).config.head_mask)``."""
    from headscope.mask import HeadMask

    register()
    if isinstance(mask, (str, Path)):
        mask = HeadMask.from_json(mask)
    if not isinstance(mask, HeadMask):
        raise TypeError(f"mask must be a headscope.HeadMask or a path to its JSON, got {type(mask).__name__}")
    opts = HybridOptions.from_dict(options)
    layers = _teacher_parts(teacher)
    mask.validate_for(teacher, require_fa_per_layer=opts.require_fa_per_layer, check_fingerprint=check_fingerprint)
    L = len(layers)
    fa_heads = [[] for _ in range(L)] if opts.granularity == "token" else [list(mask.fa_in_layer(l)) for l in range(L)]
    config = hybrid_config(teacher, fa_heads, opts)
    D, rep = config.head_dim, config.n_rep
    model = HybridForCausalLM(config)
    model.config.head_mask = mask.to_dict()  # saved in config.json with the model
    p = next(teacher.parameters())
    model.to(device=p.device, dtype=p.dtype)

    model.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight)
    model.model.norm.weight.copy_(teacher.model.norm.weight)
    if not config.tie_word_embeddings:
        model.lm_head.weight.copy_(teacher.lm_head.weight)
    for l, (layer, t_layer) in enumerate(zip(model.model.layers, layers)):
        layer.input_layernorm.weight.copy_(t_layer.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(t_layer.post_attention_layernorm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            _load(getattr(layer.mlp, name), getattr(t_layer.mlp, name).weight, getattr(t_layer.mlp, name).bias)
        attn, t_attn = layer.self_attn, t_layer.self_attn
        _load(attn.o_proj, t_attn.o_proj.weight, t_attn.o_proj.bias)
        if opts.granularity == "token":
            H, K = config.num_attention_heads, config.num_key_value_heads
            _copy_branch(attn.swa, t_attn, list(range(H)), list(range(K)), D)
            _copy_branch(attn.la, t_attn, list(range(H)), [h // rep for h in range(H)], D)
        else:
            if attn.fa is not None:
                _copy_branch(attn.fa, t_attn, attn.fa.heads, attn.fa.kv_heads, D)
                if opts.fa_nope_init == "rope_mean":
                    rope_mean_queries(attn.fa, model.model.rotary_emb, opts.fa_nope_init_length)
            if attn.la is not None:
                _copy_branch(attn.la, t_attn, attn.la.heads, [h // rep for h in attn.la.heads], D)
        attn.reset_new_parameters()
    if hasattr(teacher, "generation_config") and teacher.generation_config is not None:
        model.generation_config = copy.deepcopy(teacher.generation_config)
    model.train(teacher.training)
    return model
