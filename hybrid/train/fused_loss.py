"""Stage 2's loss without the full logits: lm_head + KL(teacher || student) + weighted CE, chunk by chunk.

    terms = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, temperature=2.0, kl=True, ce=True)
    terms["kl"], terms["ce"]  # (sum, count) each, as losses.kl_div / losses.weighted_ce on the full logits

The naive twin (``hybrid.train.losses``) computes ``h @ W^T`` for every token ([B, T, V]: 6.4 GB per float32 copy
for SmolLM2 at 16 x 2048) and lets autograd keep it and its float32 copies. Here (as Liger-Kernel's fused linear
cross-entropy) the forward loops over chunks of ``chunk_tokens`` tokens: the chunk's logits ``h_c @ W^T`` (in the
autocast dtype, else the input dtype), float32 softmax math, the loss sums, and right away the gradient of each sum
w.r.t. the chunk's logits, turned into ``grad_h_c = g @ W`` and ``grad_W += g^T @ h_c``. Only those gradients are
kept ([B, T, C] and [V, C] per term); backward scales them by the grad_output of their sum. Per chunk of N tokens:

    KL term  tau^2 * KL(p_t || p_s), p = softmax(logits / tau)   d/ds = tau * (p_s - p_t)
    CE term  w[t] * CE(s[t], ids[t + 1]) (t < T - 1)              d/ds = w[t] * (softmax(s) - onehot(ids[t + 1]))

The two sums are two outputs with their own gradients, so the trainer's loss (sum_i weight_i * sum_i / count_i, with
global counts) differentiates them as it does the naive terms. The cost: with both terms on, two matmuls more than
the naive path for the gradients (each term's g @ W and g^T @ h; the naive path adds the two terms' logit gradients
first). The lm_head bias is refused (the models here have none).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fused_distill_loss", "naive_distill_loss", "DEFAULT_CHUNK_TOKENS"]

DEFAULT_CHUNK_TOKENS = 2048  # logits of one chunk: 2048 x 49152 float32 = 0.4 GB for SmolLM2


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 math as the naive twin (``.float()``); float64 stays float64 (tests compare at float64 precision)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _matmul_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype of ``F.linear(h, W)`` here: the autocast dtype when autocast is on for h's device, else h's dtype."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev) and h.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(dev)
    return h.dtype


def _chunk_terms(s: torch.Tensor, t: torch.Tensor | None, tg: torch.Tensor, wc: torch.Tensor, tau: float,
                 do_kl: bool, do_ce: bool):
    """One chunk's (kl_sum, ce_sum, {term: d sum / d s [n, V]}); s, t [n, V] float logits (overwritten), tg [n] the
    targets, wc [n] their weights. At tau 1 the two terms share softmax(s)."""
    kl = ce = None
    g = {}
    rows = torch.arange(s.shape[0], device=s.device)  # [n]
    shared = do_kl and do_ce and tau == 1.0
    if do_kl:
        ls = F.log_softmax(s if tau == 1.0 else s / tau, -1)  # [n, V]
        lt = F.log_softmax(t if tau == 1.0 else t / tau, -1)  # [n, V]
        pt = lt.exp()  # [n, V]
        kl = lt.sub_(ls).mul_(pt).sum() * tau ** 2  # sum of p_t * (log p_t - log p_s), times tau^2
        del lt
        if shared:
            ce = -(ls[rows, tg] * wc).sum()  # log p_s at the targets
        ps = ls.exp_()  # [n, V]: softmax(s / tau)
        if shared:
            g["kl"] = ps - pt  # [n, V] (ps is kept for the CE term)
        else:
            g["kl"] = ps.sub_(pt) if tau == 1.0 else ps.sub_(pt).mul_(tau)  # [n, V]: tau * (p_s - p_t)
        del pt
    if do_ce:
        if not shared:
            lse = torch.logsumexp(s, -1)  # [n]
            ce = ((lse - s[rows, tg]) * wc).sum()
            ps = s.sub_(lse[:, None]).exp_()  # [n, V]: softmax(s), in place of s
        ps.mul_(wc[:, None])[rows, tg] -= wc  # [n, V]: w * (softmax(s) - onehot)
        g["ce"] = ps
    return kl, ce, g


class _FusedDistill(torch.autograd.Function):
    """(kl_sum, ce_sum) of flattened tokens; gradients computed in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, h_s, w_s, h_t, w_t, target, weight, temperature: float, do_kl: bool, do_ce: bool,
                chunk: int, dt: torch.dtype):
        # h_s [N, C], w_s [V, C], h_t [N, Ct] | None, w_t [V, Ct] | None, target [N] (ids[t + 1]), weight [N]
        N, C = h_s.shape
        acc = _math_dtype(dt)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(h_s.device.type, enabled=False), torch.no_grad():
            ws = w_s.to(dt)  # [V, C]
            wt = w_t.to(dt) if do_kl else None  # [V, Ct]
            names = [n for n, on in (("kl", do_kl), ("ce", do_ce)) if on]
            sums = {n: torch.zeros((), dtype=acc, device=h_s.device) for n in ("kl", "ce")}
            gh = {n: torch.empty(N, C, dtype=h_s.dtype, device=h_s.device) if need_h else None for n in names}
            gw = {n: torch.zeros(w_s.shape, dtype=acc, device=h_s.device) if need_w else None for n in names}
            tau = float(temperature)
            for a in range(0, N, chunk):
                b = min(a + chunk, N)
                hc = h_s[a:b].to(dt)  # [n, C]
                s = (hc @ ws.T).to(acc)  # [n, V]
                t = (h_t[a:b].to(dt) @ wt.T).to(acc) if do_kl else None  # [n, V]
                kl_c, ce_c, g = _chunk_terms(s, t, target[a:b], weight[a:b].to(acc), tau, do_kl, do_ce)
                del s, t
                if do_kl:
                    sums["kl"] += kl_c
                if do_ce:
                    sums["ce"] += ce_c
                for n in names:
                    gd = g.pop(n).to(dt)  # [n, V]
                    if need_h:
                        gh[n][a:b] = gd @ ws  # [n, C]
                    if need_w:
                        gw[n] += (gd.T @ hc).to(acc)  # [V, C]
                    del gd
        ctx.names = names
        # saved (not ctx attributes): autograd frees them after backward unless retain_graph, although the trainer
        # keeps the sums (and so this node) alive until its log line
        ctx.save_for_backward(*(gh[n] for n in names), *(gw[n] for n in names))
        ctx.w_dtype = w_s.dtype
        return sums["kl"], sums["ce"]

    @staticmethod
    def backward(ctx, g_kl, g_ce):
        saved, k = ctx.saved_tensors, len(ctx.names)
        gh, gw = dict(zip(ctx.names, saved[:k])), dict(zip(ctx.names, saved[k:]))
        scale = {"kl": g_kl, "ce": g_ce}
        grad_h = grad_w = None
        for n in ctx.names:
            if gh[n] is not None:
                part = gh[n] * scale[n].to(gh[n].dtype)  # [N, C]
                grad_h = part if grad_h is None else grad_h + part
            if gw[n] is not None:
                part = gw[n] * scale[n].to(gw[n].dtype)  # [V, C]
                grad_w = part if grad_w is None else grad_w + part
        if grad_w is not None:
            grad_w = grad_w.to(ctx.w_dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None, None, None


def naive_distill_loss(h_s: torch.Tensor, w_s: torch.Tensor, h_t: torch.Tensor | None, w_t: torch.Tensor | None,
                       ids: torch.Tensor, w: torch.Tensor, *, temperature: float = 1.0, kl: bool = True,
                       ce: bool = True) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The naive twin of ``fused_distill_loss`` (same arguments, same result): the full logits
    ``h @ W^T`` [B, T, V], then ``losses.kl_div`` and ``losses.weighted_ce`` on them, autograd for the gradients."""
    from hybrid.train.losses import kl_div, weighted_ce

    s = F.linear(h_s, w_s)  # [B, T, V]
    out = {}
    if kl:
        with torch.no_grad():
            t = F.linear(h_t, w_t)  # [B, T, V]
        out["kl"] = kl_div(s, t, temperature)
    if ce:
        out["ce"] = weighted_ce(s, ids, w)
    return out


def fused_distill_loss(h_s: torch.Tensor, w_s: torch.Tensor, h_t: torch.Tensor | None, w_t: torch.Tensor | None,
                       ids: torch.Tensor, w: torch.Tensor, *, temperature: float = 1.0, kl: bool = True,
                       ce: bool = True, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                       bias: torch.Tensor | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The distill terms without the [B, T, V] logits: ``{"kl": (sum, count), "ce": (sum, count)}`` (the terms
    asked for, in that order), equal to ``kl_div(h_s @ w_s^T, h_t @ w_t^T, temperature)`` and
    ``weighted_ce(h_s @ w_s^T, ids, w)``.

    h_s [B, T, C] the student's final (post-norm) hidden state; w_s [V, C] its lm_head weight (gradients reach
    both); h_t [B, T, Ct] / w_t [V, Ct] the teacher's (no gradient; needed for kl only); ids [B, T]; w [B, T] the
    weight of the target ids[:, t+1] at t. The matmuls run in the autocast dtype when autocast is on (as F.linear
    would), the softmax math in float32 (float64 inputs: float64)."""
    if bias is not None:
        raise ValueError("fused_distill_loss: the lm_head has a bias, which the fused loss does not add; use the "
                         "naive path (stage option fused_loss='off')")
    if not (kl or ce):
        raise ValueError("fused_distill_loss: kl=False and ce=False: ask for at least one term")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"fused_distill_loss: chunk_tokens={chunk_tokens!r} must be a positive int")
    B, T, C = h_s.shape
    V = w_s.shape[0]
    if w_s.shape != (V, C) or ids.shape != (B, T) or w.shape != (B, T):
        raise ValueError(f"fused_distill_loss: shapes h_s {tuple(h_s.shape)}, w_s {tuple(w_s.shape)}, ids "
                         f"{tuple(ids.shape)}, w {tuple(w.shape)}; expected [B, T, C], [V, C], [B, T], [B, T]")
    if kl:
        if h_t is None or w_t is None:
            raise ValueError("fused_distill_loss: kl=True needs the teacher's h_t and w_t")
        if h_t.shape[:2] != (B, T) or w_t.shape != (V, h_t.shape[2]):
            raise ValueError(f"fused_distill_loss: teacher shapes h_t {tuple(h_t.shape)}, w_t {tuple(w_t.shape)} "
                             f"do not match B={B}, T={T}, V={V}")
        h_t = h_t.detach().reshape(B * T, -1)  # [N, Ct]
        w_t = w_t.detach()
    dt = _matmul_dtype(h_s)
    acc = _math_dtype(dt)
    target = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1).reshape(-1)  # [N]: ids[t + 1], 0 at T-1
    weight = torch.cat([w[:, :-1].to(acc), torch.zeros_like(w[:, :1], dtype=acc)], 1).reshape(-1)  # [N]
    kl_sum, ce_sum = _FusedDistill.apply(h_s.reshape(B * T, C), w_s, h_t, w_t, target, weight, temperature,
                                         kl, ce, chunk_tokens, dt)
    out = {}
    if kl:
        out["kl"] = (kl_sum, torch.tensor(float(B * T), device=h_s.device))
    if ce:
        out["ce"] = (ce_sum, w[:, :-1].to(acc).sum())
    return out
