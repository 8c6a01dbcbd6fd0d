"""Small modules shared by the hybrid layers: RMSNorm, rotary embedding, MLP, short causal conv,
the log-length query scale, and windowed attention for the token-level baseline."""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.ops.gemv import decode_linear
from hybrid.ops.utils import acc  # noqa: F401  (re-exported: the layers' accumulation dtype)

__all__ = ["acc", "autocast_input", "index_on", "head_runs", "take_heads", "fused_linear", "inference_constant",
           "call_linear", "use_decode_gemv", "RMSNorm", "RotaryEmbedding", "apply_rope", "MLP", "ShortConv",
           "log_length_scale", "window_attention", "window_attention_dense", "grouped_attention"]


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x in the autocast dtype when autocast is on for x's device and x is float32, else x unchanged. For a
    tensor that several Linears read (a layer's normed input: every FA and GDN projection, or the MLP's gate and
    up): one cast instead of one per Linear, with the same values (autocast would round each Linear's input to
    that dtype anyway), and in the backward the Linears' input gradients are summed in that dtype and cast back
    once, instead of each being cast to float32 and summed there. (The H200's compiled SmolLM2 stage-2 step ran
    552 float32 add kernels (61 ms) and 735 copy kernels (90 ms): 19% of its 805 ms of kernels. On the CPU this
    leaves fewer than half of a hybrid layer's activation-sized casts, tests/hybrid/test_model.py; its GPU effect
    is not measured yet.)"""
    dev = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x


_INDEX_CACHE: dict[tuple, torch.Tensor] = {}


def index_on(heads: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A (cached) long tensor of head indices on ``device`` (no buffers: meta-device safe). Inside torch.compile
    the tensor is made in the graph and not cached: a cached tensor made there would be a graph output, which a
    CUDA graph (compile mode "reduce-overhead") overwrites on its next replay while the cache still holds it."""
    if torch.compiler.is_compiling():
        return torch.tensor(heads, dtype=torch.long, device=device)
    key = (heads, str(device))
    if key not in _INDEX_CACHE:
        _INDEX_CACHE[key] = torch.tensor(heads, dtype=torch.long, device=device)
    return _INDEX_CACHE[key]


def head_runs(heads: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``heads`` as runs of consecutive indices, (start, stop) each: (0, 1, 2, 6, 7) -> ((0, 3), (6, 8));
    a repeated index starts a new run: (0, 0, 1) -> ((0, 1), (0, 2))."""
    runs: list[list[int]] = []
    for h in heads:
        if runs and runs[-1][1] == h:
            runs[-1][1] += 1
        else:
            runs.append([h, h + 1])
    return tuple((a, b) for a, b in runs)


MAX_SLICE_RUNS = 4  # take_heads: up to this many runs eagerly, slices and one cat; more: index_select


def take_heads(t: torch.Tensor, dim: int, heads: tuple[int, ...]) -> torch.Tensor:
    """``t.index_select(dim, heads)`` by slices: one run is a view, a few are one ``cat``. Under torch.compile
    always slices: an index tensor made in the graph is a device constant, which AOTAutograd's cache cannot
    serialize on CUDA ("unable to serialize compiled graph"), so every start of a run compiled those layers
    again. Eagerly, more than ``MAX_SLICE_RUNS`` runs take one ``index_select`` (one kernel) instead."""
    runs = head_runs(tuple(heads))
    if len(runs) > MAX_SLICE_RUNS and not torch.compiler.is_compiling():
        return t.index_select(dim, index_on(tuple(heads), t.device))
    parts = [t.narrow(dim, a, b - a) for a, b in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _param_key(params) -> tuple:
    """What identifies the current values of ``params``: storage, in-place version, dtype, device."""
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)


_TRUST_CACHES = False  # set by trusted_inference_caches(): compiled code reads the caches below without their key


@contextmanager
def trusted_inference_caches():
    """Within: code that torch.compile traces reads ``fused_linear``'s copies and ``inference_constant``'s values
    without checking that the parameters are unchanged (the check reads data pointers, which breaks the graph).
    For a compiled step whose parameters cannot change between the eager call that made the caches and the
    compiled calls (``hybrid.decoding.Decoder``); elsewhere (e.g. a compiled model under training) the check
    stays, graph break and all. Graphs traced inside and outside are kept apart (dynamo guards on the flag)."""
    global _TRUST_CACHES
    old, _TRUST_CACHES = _TRUST_CACHES, True
    try:
        yield
    finally:
        _TRUST_CACHES = old


def _separate(linears, x: torch.Tensor, groups=None) -> list[torch.Tensor]:
    """``fused_linear``'s outputs from the separate Linears (one matmul each)."""
    outs = [lin(x) for lin in linears]
    if groups is None:
        return outs
    bounds = [sum(groups[:i]) for i in range(len(groups) + 1)]
    return [torch.cat(outs[a:b], -1) if b - a > 1 else outs[a] for a, b in zip(bounds, bounds[1:])]


def fused_linear(owner: nn.Module, name: str, linears, x: torch.Tensor, groups=None) -> list[torch.Tensor]:
    """``[lin(x) for lin in linears]`` with ONE matmul (inference): x [..., C] -> outputs [..., N_i] (views).
    ``groups`` (counts of consecutive Linears, e.g. (1, 1, 2)): return one output per group instead, the
    group's Linears' outputs side by side (``torch.cat`` of them, as one view).

    The weights are concatenated along the output dim once and kept on ``owner`` (a plain attribute, not a
    parameter or buffer: the state dict is unchanged); the copy is rebuilt when any weight or bias changes
    (new storage, dtype/device, or an in-place update: an optimizer step bumps ``_version``). Each output
    column is the same dot product as the separate Linear's (a bias of 0 is added where a Linear has none).
    Used by the decode step (T = 1), where a step is bound by the number of kernels, not bytes: under
    autograd (training), or when a Linear carries forward hooks (e.g. headscope's interventions), it falls back
    to the separate Linears, so no gradient ever flows through the copy and every hook still runs.

    Under torch.compile inside ``trusted_inference_caches()`` the key is not checked (reading a data pointer
    breaks the graph): a copy made by an earlier eager call is used as it is, and without one the separate
    Linears run (``hybrid.decoding.Decoder`` makes the copies with one eager step before its first compiled
    one)."""
    sizes = [lin.out_features for lin in linears]
    if groups is not None:
        if sum(groups) != len(linears):
            raise ValueError(f"fused_linear: groups={tuple(groups)} must add up to the {len(linears)} Linears")
        bounds = [sum(groups[:i]) for i in range(len(groups) + 1)]
        sizes = [sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])]
    if (any(lin._forward_hooks or lin._forward_pre_hooks for lin in linears)  # hooks (interventions) must run
            or torch.is_grad_enabled() and any(p.requires_grad for lin in linears for p in lin.parameters())):
        return _separate(linears, x, groups)
    if _TRUST_CACHES and torch.compiler.is_compiling():
        hit = owner.__dict__.get("_fused_linears", {}).get(name)
        if hit is None:
            return _separate(linears, x, groups)
        return list(_linear(x, hit[1], hit[2], linears).split(sizes, dim=-1))  # [..., N_i] each
    params = [p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
    key = _param_key(params)
    store = owner.__dict__.setdefault("_fused_linears", {})
    hit = store.get(name)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            w = torch.cat([lin.weight for lin in linears], 0)  # [sum N_i, C]
            b = None
            if any(lin.bias is not None for lin in linears):
                b = torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                               for lin in linears])  # [sum N_i]
        hit = store[name] = (key, w, b)
    y = _linear(x, hit[1], hit[2], linears)  # [..., sum N_i]
    return list(y.split(sizes, dim=-1))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, linears) -> torch.Tensor:
    """F.linear of the fused copy of ``linears``, or the decode GEMV (``hybrid.ops.gemv.decode_linear``: F.linear
    itself past its rows) where ``use_decode_gemv`` switched every one of them on."""
    if all(getattr(lin, "decode_gemv", False) for lin in linears):
        return decode_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def call_linear(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` [..., N]; by the decode GEMV (``hybrid.ops.gemv``) where ``use_decode_gemv`` switched ``lin``
    on and it carries no hooks (interventions run through the Linear's own call). The GEMV takes decode rows
    only (at most ``hybrid.ops.gemv.MAX_ROWS``, no gradient); other calls are ``F.linear``."""
    if getattr(lin, "decode_gemv", False) and not (lin._forward_hooks or lin._forward_pre_hooks):
        return decode_linear(x, lin.weight, lin.bias)
    return lin(x)


def use_decode_gemv(model: nn.Module, on: bool = True) -> int:
    """Route ``model``'s projections through the decode GEMV (``call_linear``, ``fused_linear``): every
    ``nn.Linear`` of it gets ``decode_gemv = on`` (read by the layers that call them: the decode input
    projections, o_proj, the MLP's and the output head). Returns how many Linears it set. Prefill, training and
    hooked Linears are unchanged (``call_linear``); ``on=False`` restores F.linear everywhere. A decode step
    captured before the switch (a ``Decoder``'s CUDA graph, the one ``generate()`` keeps with the model) replays
    the kernels it captured: switch before decoding, or ``hybrid.generation.release(model)`` after."""
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.decode_gemv = bool(on)
            n += 1
    return n


def inference_constant(owner: nn.Module, name: str, params, fn):
    """``fn()`` (a function of ``params`` only) cached on ``owner`` while no gradient is needed and the params
    are unchanged (same key as ``fused_linear``); under autograd it is recomputed every call. Under torch.compile
    inside ``trusted_inference_caches()`` a value cached by an earlier eager call is used without checking the
    key (as ``fused_linear``), else ``fn()`` is computed in the graph."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return fn()
    if _TRUST_CACHES and torch.compiler.is_compiling():
        hit = owner.__dict__.get("_inference_constants", {}).get(name)
        return fn() if hit is None else hit[1]
    key = _param_key(params)
    store = owner.__dict__.setdefault("_inference_constants", {})
    hit = store.get(name)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = store[name] = (key, fn())
    return hit[1]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 (same numerics as Llama/Qwen3's)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # = weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype), as Qwen3/Llama; one fused norm kernel
        # instead of five (it matters when decoding one token, where every layer's kernels are tiny). Half
        # types: F.rms_norm accumulates in float32 and rounds once, the same values without the two casts;
        # float64 is normalised in float32 (as the HF teacher does), so it keeps them.
        if x.dtype in (torch.float16, torch.bfloat16):
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions; "default" RoPE here, other rope types via transformers.

    The inverse frequencies are recomputed (D/2 numbers) instead of kept in a buffer, so a model built on
    the meta device by ``from_pretrained`` needs no special re-initialisation."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        rope = dict(config.rope_parameters)
        self.rope_type = rope.get("rope_type", rope.get("type", "default"))
        if self.rope_type != "default":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if self.rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"rope_type={self.rope_type!r} is not known to transformers; cannot build RoPE")

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        if self.rope_type == "default":
            D = self.config.head_dim
            theta = self.config.rope_parameters["rope_theta"]
            return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float) / D)), 1.0  # [D/2]
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, None)
        return inv_freq.float(), float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (0-based absolute) -> cos, sin [T, D] in ``dtype``."""
        inv_freq, scaling = self.inv_freq()
        freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D], cos/sin [T, D] (shared positions) or [B, T, D] (per row) -> rotated x [B, T, H, D]
    (rotate-half convention of HF)."""
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, D]
    else:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # [1, T, 1, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_kept_frequencies(inv_freq: torch.Tensor, max_wavelength: float | None) -> int:
    """How many of the rotary frequencies ``inv_freq`` [D/2] (fastest first) have a wavelength 2*pi/theta of at
    most ``max_wavelength`` positions: partial RoPE rotates these and leaves the slower ones unrotated. None: all."""
    n = inv_freq.numel()
    if max_wavelength is None:
        return n
    if n > 1 and not bool((inv_freq[1:] <= inv_freq[:-1]).all()):
        raise ValueError("partial RoPE needs the rotary frequencies in decreasing order (fastest first); this rope "
                         "type's are not: use fa_rope_max_wavelength=None")
    return int((2 * math.pi / inv_freq <= max_wavelength).sum())


def partial_rope_tables(cos: torch.Tensor, sin: torch.Tensor, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D] or [B, T, D] for apply_rope that rotate only the first ``kept`` frequencies of each rotate-half
    pair (cos 1, sin 0 on the others, which then pass unrotated); all kept: the tables as they are."""
    D = cos.shape[-1]
    if kept >= D // 2:
        return cos, sin
    on = (torch.arange(D, device=cos.device) % (D // 2)) < kept  # [D] the rotated dims
    return torch.where(on, cos, torch.ones_like(cos)), sin * on


def log_length_scale(positions: torch.Tensor, base: float) -> torch.Tensor:
    """s_t = log(t + a) / log(a) with t = position + 1 (1-based). positions [T] or [B, T] -> same shape, float32."""
    t = positions.float() + 1.0  # [T] or [B, T]
    return torch.log(t + base) / math.log(base)


class MLP(nn.Module):
    """Gated MLP of Llama/Qwen: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int, act: str, bias: bool = False) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act_fn(call_linear(self.gate_proj, x)) * call_linear(self.up_proj, x)  # [..., inner]
        return call_linear(self.down_proj, h)  # [..., hidden]


def mark_new(module: nn.Module, *names: str) -> None:
    """Mark parameters as new in the hybrid (not copied from the teacher), where they are created.

    ``module``'s parameters ``names`` (default: all its own) get ``param._hybrid_new = True`` (as fla marks
    ``_no_weight_decay``), and the names are recorded on the module (``module._hybrid_new_names``), which
    survives loaders and FSDP that replace the Parameter objects. ``HybridForCausalLM.new_parameters()``
    reads both."""
    own = dict(module.named_parameters(recurse=False))
    names = names or tuple(own)
    missing = [n for n in names if n not in own]
    if missing:
        raise ValueError(f"mark_new: {type(module).__name__} has no parameter(s) {missing}")
    module._hybrid_new_names = frozenset(getattr(module, "_hybrid_new_names", frozenset()) | set(names))
    for n in names:
        own[n]._hybrid_new = True


def is_new(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    return bool(getattr(param, "_hybrid_new", False)) or name in getattr(module, "_hybrid_new_names", ())


class NewLinear(nn.Linear):
    """A Linear that is new in the hybrid (gates, beta / decay projections): marked, and initialised to zeros
    (``reset_new_parameters``), so its output starts at 0 (plus a zero bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        mark_new(self)
        self.reset_new_parameters()

    def reset_new_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            if self.bias is not None:
                self.bias.zero_()


class ShortConv(nn.Module):
    """Causal depthwise conv over time (kernel W), initialised to the identity (last tap 1, others 0).

    Unlike fla's ShortConvolution there is no activation, so a freshly built hybrid passes q/k/v through
    unchanged. ``state`` holds the last W-1 inputs for decoding.
    """

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.zeros(channels, kernel))  # [C, W] new
        mark_new(self)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.weight[:, -1] = 1.0

    reset_new_parameters = reset_parameters

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C], state [B, W-1, C] or None -> y [B, T, C], new state [B, W-1, C]."""
        B, T, C = x.shape
        W = self.kernel
        if state is None:
            state = x.new_zeros(B, W - 1, C)  # [B, W-1, C]
        xx = torch.cat([state.to(x.dtype), x], dim=1)  # [B, W-1+T, C]
        if T == 1:  # decode: one dot product per channel
            y = (xx * self.weight.t()[None].to(x.dtype)).sum(1, keepdim=True)  # [B, 1, C]
        else:
            y = F.conv1d(xx.transpose(1, 2), self.weight[:, None, :].to(x.dtype), groups=C)  # [B, C, T]
            y = y.transpose(1, 2).contiguous()  # [B, T, C] (kernels and norms want rows contiguous)
        return y, xx[:, xx.shape[1] - (W - 1):]


def window_attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, q_offset: int,
                           k_offset: int, scale: float) -> torch.Tensor:
    """The twin of ``window_attention``: SDPA with an explicit [T, S] mask (O(T*S) memory).

    q [B, T, H, D] at absolute positions q_offset.., k/v [B, S, H, D] at k_offset..; each query sees the
    ``window`` most recent keys including itself. Returns o [B, T, H, D].
    """
    T, S = q.shape[1], k.shape[1]
    qpos = torch.arange(T, device=q.device) + q_offset  # [T]
    kpos = torch.arange(S, device=q.device) + k_offset  # [S]
    allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)  # [T, S]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=allowed, scale=scale)  # [B, H, T, D]
    return o.transpose(1, 2)


WINDOW_CHUNK_MIN = 256  # query chunk of the windowed kernel: max(window, this) queries per SDPA call


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, q_offset: int,
                     k_offset: int, scale: float) -> torch.Tensor:
    """Causal sliding-window attention at any length: SDPA over query chunks of C = max(window, 256)
    positions, each against only the C + window - 1 keys it can see (masks [C, C + window - 1]; memory
    O(T * (C + window)), never [T, S]). Same function as ``window_attention_dense`` (tested equal).

    q [B, T, H, D] at absolute positions q_offset.., k/v [B, S, H, D] at k_offset..; each query sees the
    ``window`` most recent keys including itself. Returns o [B, T, H, D].
    """
    T, S = q.shape[1], k.shape[1]
    C = max(window, WINDOW_CHUNK_MIN)
    if T <= C:
        # one chunk: keys from the first visible one
        lo = max(0, q_offset - window + 1 - k_offset)
        hi = min(S, q_offset + T - k_offset)
        return window_attention_dense(q, k[:, lo:hi], v[:, lo:hi], window, q_offset, k_offset + lo, scale)
    outs = []
    for a in range(0, T, C):
        qa = q_offset + a  # absolute position of the chunk's first query
        lo = max(0, qa - window + 1 - k_offset)  # first key any query of the chunk sees
        hi = min(S, qa + min(C, T - a) - k_offset)  # one past the last key (causal)
        outs.append(window_attention_dense(q[:, a:a + C], k[:, lo:hi], v[:, lo:hi], window, qa, k_offset + lo,
                                           scale))  # [B, C, H, D]
    return torch.cat(outs, 1)  # [B, T, H, D]


# mask elements (B x H/K x T x S) per SDPA call of grouped_attention: a longer prefill goes in query chunks, so that
# the head-expanded mask (and the float copy SDPA makes of a boolean one) stays ~1 GiB instead of growing as B x T x S
GROUPED_MASK_ELEMENTS = 1 << 28


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Masked attention with GQA and no KV copy: the H / K query heads of each KV head become extra query rows.

    q [B, T, H, D]; k, v [B, S, K, D] with H a multiple of K (query head h reads KV head h // (H / K));
    mask [B, T, S] bool, True where query (b, t) may attend key s. Returns o [B, T, H, D]. A query row whose
    mask is all False gives NaN (SDPA); callers always leave the query's own key visible. Queries go to SDPA in
    chunks of at most ``GROUPED_MASK_ELEMENTS`` mask elements (each query row's result does not depend on the
    others; a decode step of one token per row is one call)."""
    B, T, H, D = q.shape
    rep, S = H // k.shape[2], mask.shape[-1]
    step = max(1, GROUPED_MASK_ELEMENTS // max(1, B * rep * S))
    if T <= step:
        return _grouped_attention(q, k, v, mask, scale)
    return torch.cat([_grouped_attention(q[:, a:a + step], k, v, mask[:, a:a + step], scale)
                      for a in range(0, T, step)], 1)  # [B, T, H, D]


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    B, T, H, D = q.shape
    K = k.shape[2]
    rep = H // K
    qg = q.reshape(B, T, K, rep, D).permute(0, 2, 3, 1, 4).reshape(B, K, rep * T, D)  # [B, K, rep*T, D]
    m = mask[:, None, None].expand(B, 1, rep, T, mask.shape[-1]).reshape(B, 1, rep * T, mask.shape[-1])
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=m,
                                       scale=scale)  # [B, K, rep*T, D]
    return o.reshape(B, K, rep, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)
