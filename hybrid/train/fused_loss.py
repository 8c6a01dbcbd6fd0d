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

On CUDA, when torch has float32-output matmuls of bf16 / fp16 inputs (``torch.mm(..., out_dtype=)``, probed once),
the chunk's logits come out of the matmul in float32 and ``grad_W`` is accumulated by ``torch.addmm(..., out_dtype=)``:
no half-precision logits and no cast copy of them, and no [V, C] cast and add per chunk and term (the H200's
SmolLM2 step ran 128 of each: docs/training.md). ``f32_matmul`` turns this off (False) or insists on it (True).

The softmax math of a chunk is ~20 passes over its [n, V] float32 logits when run op by op (log-softmaxes, exps,
products, differences, casts: ~160 ms of the H200's SmolLM2 step at batch 64). ``chunk_math="compiled"`` runs it
as one pure function under torch.compile (``_chunk_terms_pure``: the same sums, the gradients written straight in
the matmul dtype), which inductor fuses into a few kernels; "auto" does so on CUDA, and keeps the in-place eager
``_chunk_terms`` (the least memory) on the CPU. A compile that fails falls back to the eager math with a warning.

The two sums are two outputs with their own gradients, so the trainer's loss (sum_i weight_i * sum_i / count_i, with
global counts) differentiates them as it does the naive terms. The cost: with both terms on, two matmuls more than
the naive path for the gradients (each term's g @ W and g^T @ h; the naive path adds the two terms' logit gradients
first). The lm_head bias is refused (the models here have none).
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

__all__ = ["fused_distill_loss", "naive_distill_loss", "DEFAULT_CHUNK_TOKENS", "out_dtype_matmul_available",
           "CHUNK_MATHS"]

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


@functools.lru_cache(maxsize=None)
def out_dtype_matmul_available(device_type: str) -> bool:
    """Whether ``torch.mm`` / ``torch.addmm`` take ``out_dtype=torch.float32`` for bf16 inputs on this device type
    (CUDA in recent torch; probed once on a 2 x 2 problem)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")  # [2, 2]
        c = torch.ones(2, 2, dtype=torch.float32, device="cuda")  # [2, 2]
        ok = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        return ok and bool(torch.addmm(c, a, a, out_dtype=torch.float32).eq(3).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _use_f32_matmul(f32_matmul: bool | None, device: torch.device, dt: torch.dtype, acc: torch.dtype) -> bool:
    if dt == acc:  # float32 / float64 matmuls: their output is already the math dtype
        return False
    avail = out_dtype_matmul_available(device.type)
    if f32_matmul and not avail:
        raise RuntimeError(f"fused_distill_loss(f32_matmul=True): torch {torch.__version__} on {device.type} has no "
                           f"float32-output matmul of {dt} inputs (torch.mm(..., out_dtype=)); leave f32_matmul=None")
    return avail if f32_matmul is None else bool(f32_matmul)


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


def _chunk_terms_pure(s: torch.Tensor, t: torch.Tensor | None, tg: torch.Tensor, wc: torch.Tensor, tau: float,
                      do_kl: bool, do_ce: bool, gdtype: torch.dtype):
    """``_chunk_terms`` without in-place ops, for torch.compile: (kl_sum, ce_sum, {term: gradient [n, V] in
    ``gdtype``}); s, t [n, V] float logits (left unchanged), tg [n] targets, wc [n] their weights."""
    kl = ce = None
    g = {}
    if do_kl:
        ls = F.log_softmax(s / tau, -1)  # [n, V]
        lt = F.log_softmax(t / tau, -1)  # [n, V]
        pt = lt.exp()  # [n, V]
        kl = (pt * (lt - ls)).sum() * tau ** 2
        g["kl"] = ((ls.exp() - pt) * tau).to(gdtype)  # [n, V]: tau * (p_s - p_t)
    if do_ce:
        lse = torch.logsumexp(s, -1)  # [n]
        ce = ((lse - s.gather(1, tg[:, None])[:, 0]) * wc).sum()
        hit = torch.arange(s.shape[1], device=s.device)[None, :] == tg[:, None]  # [n, V]: the one-hot of the targets
        g["ce"] = (((s - lse[:, None]).exp() - hit.to(s.dtype)) * wc[:, None]).to(gdtype)  # [n, V]
    return kl, ce, g


CHUNK_MATHS = ("auto", "eager", "compiled")
_COMPILED: dict = {}  # "fn": the torch.compile'd _chunk_terms_pure, made at first use; "failed": its error


def _chunk_math(chunk_math: str, device: torch.device) -> str:
    if chunk_math not in CHUNK_MATHS:
        raise ValueError(f"fused_distill_loss: chunk_math={chunk_math!r}; use one of {CHUNK_MATHS}")
    if chunk_math == "auto":
        return "compiled" if device.type == "cuda" and "failed" not in _COMPILED else "eager"
    return chunk_math


def _compiled_chunk_terms(*args):
    """The compiled chunk math; on a compile error: a warning, and the eager math from then on (None returned)."""
    if "failed" in _COMPILED:
        return None
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(_chunk_terms_pure, dynamic=None)
    try:
        return _COMPILED["fn"](*args)
    except torch.OutOfMemoryError:  # not a compile failure: the caller's to handle (a sweep's side run ends)
        raise
    except Exception as err:  # an inductor / Triton failure costs speed, not the run
        _COMPILED["failed"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        warnings.warn(f"fused_distill_loss: the compiled chunk math failed ({_COMPILED['failed']}); the eager math "
                      "is used from now on (chunk_math='eager' avoids the attempt)", stacklevel=3)
        return None


class _FusedDistill(torch.autograd.Function):
    """(kl_sum, ce_sum) of flattened tokens; gradients computed in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, h_s, w_s, h_t, w_t, target, weight, temperature: float, do_kl: bool, do_ce: bool,
                chunk: int, dt: torch.dtype, f32mm: bool, math: str):
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
                if f32mm:  # float32 straight out of the matmul (float32 accumulation either way)
                    s = torch.mm(hc, ws.T, out_dtype=acc)  # [n, V]
                    t = torch.mm(h_t[a:b].to(dt), wt.T, out_dtype=acc) if do_kl else None  # [n, V]
                else:
                    s = (hc @ ws.T).to(acc)  # [n, V]
                    t = (h_t[a:b].to(dt) @ wt.T).to(acc) if do_kl else None  # [n, V]
                res = None
                if math == "compiled":
                    res = _compiled_chunk_terms(s, t, target[a:b], weight[a:b].to(acc), tau, do_kl, do_ce, dt)
                kl_c, ce_c, g = res if res is not None else _chunk_terms(s, t, target[a:b], weight[a:b].to(acc),
                                                                         tau, do_kl, do_ce)
                del s, t
                if do_kl:
                    sums["kl"] += kl_c
                if do_ce:
                    sums["ce"] += ce_c
                for n in names:
                    gd = g.pop(n).to(dt)  # [n, V]
                    if need_h:
                        gh[n][a:b] = gd @ ws  # [n, C]
                    if need_w and f32mm:
                        gw[n] = torch.addmm(gw[n], gd.T, hc, out_dtype=acc)  # [V, C]
                    elif need_w:
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
        return grad_h, grad_w, None, None, None, None, None, None, None, None, None, None, None


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
                       bias: torch.Tensor | None = None,
                       f32_matmul: bool | None = None,
                       chunk_math: str = "auto") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The distill terms without the [B, T, V] logits: ``{"kl": (sum, count), "ce": (sum, count)}`` (the terms
    asked for, in that order), equal to ``kl_div(h_s @ w_s^T, h_t @ w_t^T, temperature)`` and
    ``weighted_ce(h_s @ w_s^T, ids, w)``.

    h_s [B, T, C] the student's final (post-norm) hidden state; w_s [V, C] its lm_head weight (gradients reach
    both); h_t [B, T, Ct] / w_t [V, Ct] the teacher's (no gradient; needed for kl only); ids [B, T]; w [B, T] the
    weight of the target ids[:, t+1] at t. The matmuls run in the autocast dtype when autocast is on (as F.linear
    would), the softmax math in float32 (float64 inputs: float64). ``f32_matmul``: half-precision matmuls with
    float32 outputs (module docstring); None: where torch has them (CUDA), False: never, True: required.
    ``chunk_math``: "compiled" (the chunk's softmax math fused by torch.compile), "eager", or "auto" (compiled on
    CUDA)."""
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
    f32mm = _use_f32_matmul(f32_matmul, h_s.device, dt, acc)
    math = _chunk_math(chunk_math, h_s.device)
    kl_sum, ce_sum = _FusedDistill.apply(h_s.reshape(B * T, C), w_s, h_t, w_t, target, weight, temperature,
                                         kl, ce, chunk_tokens, dt, f32mm, math)
    out = {}
    if kl:
        out["kl"] = (kl_sum, torch.tensor(float(B * T), device=h_s.device))
    if ce:
        out["ce"] = (ce_sum, w[:, :-1].to(acc).sum())
    return out
