"""The head-level hybrid mixer of one layer: FA heads and Gated DeltaNet heads side by side.

    x [B, T, C] --+--> FullAttentionBranch (H_F heads, NoPE, log-length query scale, output gate) --+
                  +--> GatedDeltaNetBranch (H_L heads, RoPE, L2-normed q/k, gated delta rule) ------+
                                           HeadMerge (per-head RMSNorm * gamma, original order) <---+
                                           o_proj (the teacher's, unchanged) -> [B, T, C]

Reused (copied from the teacher by ``hybrid.convert``): FA q/k/v rows, GDN q rows and k/v rows (one copy
of its KV head per GDN head), q_norm/k_norm, o_proj. New: FA ``gate_proj``, GDN ``b_proj`` (beta),
``a_proj``/``A_log``/``dt_bias`` (decay), the short convs, and the merge's gamma / branch gate.
Each new parameter is marked where it is created (``hybrid.layers.common.mark_new``);
``HybridForCausalLM.new_parameters()`` lists the marked ones. ``reset_new_parameters`` is their one
initialisation (``_init_weights`` calls it for a bare model; ``from_mask`` after copying the teacher).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.cache import LayerCache
from hybrid.config import HybridConfig
from hybrid.layers.common import (NewLinear, RMSNorm, RotaryEmbedding, ShortConv, acc, apply_rope, fused_linear,
                                  grouped_attention, inference_constant, log_length_scale, mark_new,
                                  partial_rope_tables, rope_kept_frequencies, take_heads, window_attention)
from hybrid.layers.merge import FORMER_NAME, HeadMerge
from hybrid.ops.gdn_decode import DECODE_BACKENDS

__all__ = ["FullAttentionBranch", "GatedDeltaNetBranch", "HybridAttention", "use_fused_decode"]


def qk_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` as one fused op (same values: float32 math for half types, rounded once, times the weight).
    float64 keeps RMSNorm's own path (it runs in float32, as the HF teacher's does)."""
    if x.dtype == torch.float64:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), eps=norm.eps) * norm.weight.to(x.dtype)


class FullAttentionBranch(nn.Module):
    """Softmax attention on the query heads ``heads`` (GQA kept: only their KV heads are projected)."""

    def __init__(self, config: HybridConfig, heads: list[int], rope: bool, log_scale: bool, gate: str,
                 window: int | None = None) -> None:
        super().__init__()
        C, D, rep = config.hidden_size, config.head_dim, config.n_rep
        opts = config.options
        self.heads = list(heads)
        self.kv_heads = sorted({h // rep for h in heads})  # teacher KV heads kept
        self.n_heads, self.n_kv, self.head_dim = len(self.heads), len(self.kv_heads), D
        self.rope, self.log_scale, self.window = rope, log_scale, window
        self.log_base, self.backend = opts.log_scale_base, opts.attn_backend
        # frequencies rotated (fastest first): all of them, or those of partial RoPE (fa_rope_max_wavelength)
        # (on the CPU: from_pretrained builds the model under a meta-device context, where no value can be read)
        with torch.device("cpu"):
            self.rope_kept = (rope_kept_frequencies(RotaryEmbedding(config).inv_freq()[0],
                                                    opts.fa_rope_max_wavelength) if rope else 0)
        self.q_proj = nn.Linear(C, self.n_heads * D, bias=config.qkv_bias)
        self.k_proj = nn.Linear(C, self.n_kv * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(C, self.n_kv * D, bias=config.qkv_bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(D, config.rms_norm_eps) if config.qk_norm else None
        self.gate_proj = NewLinear(C, self.n_heads * D, bias=True) if gate == "sigmoid2" else None  # new
        kv_of = [self.kv_heads.index(h // rep) for h in self.heads]  # kept-KV index of each FA head
        group = self.n_heads // self.n_kv
        # GQA works directly when each kept KV head serves one consecutive, equal-size run of FA heads
        self.gqa = self.n_heads % self.n_kv == 0 and kv_of == [i // group for i in range(self.n_heads)]
        self.kv_of = tuple(kv_of)  # [H_F]
        self.reset_new_parameters()

    def reset_new_parameters(self) -> None:
        if self.gate_proj is not None:  # 2 * sigmoid(0 x + 0) = 1: the gate starts as the identity
            self.gate_proj.reset_new_parameters()

    def decode_linears(self) -> tuple[nn.Linear, ...]:
        """The projections of x a decode step makes, in order: q, k, v and the gate if any."""
        return (self.q_proj, self.k_proj, self.v_proj) + ((self.gate_proj,) if self.gate_proj is not None else ())

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None, proj: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x [B, T, C], positions [T] absolute -> o [B, T, H_F, D] (gated). ``proj``: ``decode_linears()``'s
        outputs already computed (the layer's one matmul for both branches, HybridAttention)."""
        B, T, _ = x.shape
        D = self.head_dim
        per_row = cache is not None and getattr(cache, "per_row", False)  # preallocated cache, per-row lengths
        gate = None  # [B, T, H*D] gate logits when computed with q/k/v
        if proj is not None or per_row and cache.fuse_projections:  # decoding: q/k/v (and the gate) as one matmul
            q, k, v, *rest = proj if proj is not None else fused_linear(self, "qkv_gate", self.decode_linears(), x)
            gate = rest[0] if rest else None  # [B, T, H*D], [B, T, K*D] x2, [B, T, H*D]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, D)  # [B, T, H, D]
        k = k.view(B, T, self.n_kv, D)  # [B, T, K, D]
        v = v.view(B, T, self.n_kv, D)  # [B, T, K, D]
        if self.q_norm is not None:
            q, k = qk_norm(self.q_norm, q), qk_norm(self.k_norm, k)
        if self.rope:
            cos, sin = partial_rope_tables(cos, sin, self.rope_kept)  # once for q and k; all kept: as given
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.log_scale:  # positions [T] (shared) or [B, T] (per row: computed once per step for all layers)
            s = (cache.step.log_scale(self.log_base, q.dtype) if per_row
                 else log_length_scale(positions, self.log_base).to(q.dtype))  # [B, T] or [T]
            q = q * (s[None, :, None, None] if s.dim() == 1 else s[:, :, None, None])
        if per_row:
            o = self._attend_rows(q, k, v, cache)  # [B, T, H, D]
            if self.gate_proj is not None:
                gate = self.gate_proj(x) if gate is None else gate  # [B, T, H*D]
                o = o * (2 * torch.sigmoid(gate)).view(B, T, self.n_heads, D)
            return o
        # the queries' position relative to the keys, a Python int from the cache (no device->host sync, no graph
        # break under torch.compile): only q_offset - k_start matters, and without a cache the keys are the queries
        q_offset = cache.seen_kv() if cache is not None else 0
        k_start = q_offset
        if cache is not None:
            keep = self.window - 1 if self.window is not None else None
            k, v, k_start = cache.append_kv(k, v, keep=keep)  # [B, S, K, D]
        if not self.gqa:  # irregular head subset: one KV copy per FA head (cache still holds K heads)
            k, v = take_heads(k, 2, self.kv_of), take_heads(v, 2, self.kv_of)  # [B, S, H, D]
        if self.window is not None:
            if k.shape[2] != self.n_heads:  # GQA here (consecutive runs): repeat each KV head
                rep = self.n_heads // k.shape[2]
                k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)  # [B, S, H, D]
            o = window_attention(q, k, v, self.window, q_offset, k_start, D ** -0.5)  # [B, T, H, D]
        else:
            from hybrid.ops import attention

            o = attention(q, k, v, causal=True, scale=D ** -0.5, backend=self.backend, q_offset=q_offset - k_start)
        if self.gate_proj is not None:
            o = o * (2 * torch.sigmoid(self.gate_proj(x))).view(B, T, self.n_heads, D)
        return o  # [B, T, H, D]


    def _attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache) -> torch.Tensor:
        """Write k/v [B, T, K, D] at each row's positions of a preallocated cache and attend with the cache's
        per-step key mask [B, T, S] (causal per row, window for the token-level baseline; no host sync)."""
        B, T = q.shape[:2]
        keys, values, mask = cache.write_rows(k, v, window=self.window)  # [B, S, K, D] x2, [B, T, S]
        if T == 1 and self.gqa and self.backend == "auto":  # one token per row: split-KV decode kernel on CUDA
            from hybrid.ops.decode_attention import decode_attention

            return decode_attention(q, keys, values, cache.step.kv_len, self.head_dim ** -0.5, self.window)
        if not self.gqa:  # irregular head subset: one KV copy per FA head
            keys, values = take_heads(keys, 2, self.kv_of), take_heads(values, 2, self.kv_of)  # [B, S, H, D]
        return grouped_attention(q, keys, values, mask, self.head_dim ** -0.5)


class GatedDeltaNetBranch(nn.Module):
    """Gated DeltaNet on the query heads ``heads``: one key/value head per query head (MHA)."""

    def __init__(self, config: HybridConfig, heads: list[int]) -> None:
        super().__init__()
        C, D = config.hidden_size, config.head_dim
        opts = config.options
        self.heads, self.n_heads, self.head_dim = list(heads), len(heads), D
        self.decay, self.backend, self.seed = opts.decay, opts.gdn_backend, opts.seed
        self.fold_heads = opts.gdn_fold_heads
        self.prologue_backend = opts.prologue_backend
        # "split" (default): the decode step as separate ops; "fused": hybrid.ops.gdn_decode (one Triton kernel on
        # CUDA) for per-row static-cache steps of one token per row. Off until run on a GPU (docs/kernels.md);
        # hybrid.layers.hybrid_attention.use_fused_decode(model) switches a whole model
        self.decode_backend = "split"
        HD = self.n_heads * D
        self.q_proj = nn.Linear(C, HD, bias=config.qkv_bias)
        self.k_proj = nn.Linear(C, HD, bias=config.qkv_bias)
        self.v_proj = nn.Linear(C, HD, bias=config.qkv_bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(D, config.rms_norm_eps) if config.qk_norm else None
        self.b_proj = NewLinear(C, self.n_heads, bias=True)  # new: beta = sigmoid(b_proj(x)) = 0.5 at init
        self.a_proj = NewLinear(C, self.n_heads, bias=False)  # new: decay input, 0 at init
        if self.decay == "gdn":
            self.A_log = nn.Parameter(torch.zeros(self.n_heads))  # [H]
            self.dt_bias = nn.Parameter(torch.zeros(self.n_heads))  # [H]
        else:
            self.a_bias = nn.Parameter(torch.zeros(self.n_heads))  # [H]
        decay_params = ("A_log", "dt_bias") if self.decay == "gdn" else ("a_bias",)
        mark_new(self, *decay_params)
        for n in decay_params:
            getattr(self, n)._no_weight_decay = True  # as fla's GatedDeltaNet
        self.convs = opts.gdn_conv
        if self.convs:
            self.q_conv, self.k_conv, self.v_conv = (ShortConv(HD, opts.conv_size) for _ in range(3))
        self.reset_new_parameters()

    def reset_new_parameters(self) -> None:
        """beta = 0.5, decay independent of x at init; A and dt drawn as in fla's GatedDeltaNet (seeded)."""
        gen = torch.Generator().manual_seed(self.seed + 7919 * (self.heads[0] if self.heads else 0))
        self.b_proj.reset_new_parameters()
        self.a_proj.reset_new_parameters()
        with torch.no_grad():
            if self.decay == "gdn":  # A ~ U(1, 16), dt ~ logU(1e-3, 1e-1): per-step decay exp(-A dt) in ~[0.2, 1)
                A = torch.empty(self.n_heads, device="cpu").uniform_(1, 16, generator=gen)
                dt = torch.exp(torch.rand(self.n_heads, generator=gen, device="cpu") * (math.log(0.1) - math.log(1e-3))
                               + math.log(1e-3)).clamp(min=1e-4)
                self.A_log.copy_(torch.log(A))
                self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            else:  # sigmoid(a_bias) ~ U(0.9, 0.999): slow decays
                keep = torch.empty(self.n_heads, device="cpu").uniform_(0.9, 0.999, generator=gen)
                self.a_bias.copy_(torch.log(keep / (1 - keep)))
            if self.convs:
                for conv in (self.q_conv, self.k_conv, self.v_conv):
                    conv.reset_parameters()

    def log_decay(self, x: torch.Tensor, a: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, C] -> g [B, T, H] (float32 for half inputs), log decay <= 0. ``a``: a_proj(x) if computed.

        The parameter-only factors (-exp(A_log), the float32 biases) are kept between calls while no
        gradient is needed (``inference_constant``: four fewer kernels per decode step, same values)."""
        a = acc(self.a_proj(x) if a is None else a)  # [B, T, H]
        if self.decay == "gdn":
            neg_A = inference_constant(self, "neg_A", (self.A_log,), lambda: -acc(self.A_log).exp())  # [H]
            dt_bias = inference_constant(self, "dt_bias", (self.dt_bias,), lambda: acc(self.dt_bias))  # [H]
            return neg_A * F.softplus(a + dt_bias)
        return F.logsigmoid(a + inference_constant(self, "a_bias", (self.a_bias,), lambda: acc(self.a_bias)))

    DECODE_GROUPS = (1, 1, 1, 2)  # decode_linears() as q, k, v and [b | a]

    def decode_linears(self) -> tuple[nn.Linear, ...]:
        """The projections of x a decode step makes, in order (``DECODE_GROUPS`` puts b and a side by side)."""
        return self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.a_proj

    def one_matmul(self, per_row: bool, B: int, T: int) -> bool:
        """Whether this step's projections are one matmul with strided outputs: one token (the slices stay
        contiguous), or the fused decode op at any batch (its kernel reads q/k/v/b/a through their row and head
        strides; the split path's prologue and fla would copy them)."""
        return per_row and (B * T == 1 or self._fused_step(per_row, T))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None, proj: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x [B, T, C] -> o [B, T, H_L, D]. ``proj``: ``decode_linears()``'s outputs grouped by ``DECODE_GROUPS``,
        already computed (the layer's one matmul for both branches, HybridAttention), where ``one_matmul``."""
        from hybrid.ops import gated_delta_rule
        from hybrid.ops.prologue import gdn_qk_prologue

        B, T, _ = x.shape
        D, H = self.head_dim, self.n_heads
        per_row = cache is not None and getattr(cache, "per_row", False)  # decoding on a preallocated cache
        per_row = per_row and cache.fuse_projections  # its switch for one matmul per branch (fused_linear)
        b = a = None  # [B, T, H] b_proj(x), a_proj(x) (float32 for half types) when computed with the others
        fused = self._fused_step(per_row, T)
        if proj is not None or self.one_matmul(per_row, B, T):  # all five projections as one matmul
            q, k, v, ba = proj if proj is not None else fused_linear(self, "qkvba", self.decode_linears(), x,
                                                                     groups=self.DECODE_GROUPS)  # [B, T, 2H] last
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, H*D] each
            ba = None
            if per_row:  # split path, rows > 1: q/k/v separate (the prologue and fla would copy strided slices)
                ba = fused_linear(self, "ba", (self.b_proj, self.a_proj), x, groups=(2,))[0]  # [B, T, 2H]
        if ba is not None and not fused:
            b, a = acc(ba).split(H, dim=-1)  # [B, T, H] x2: one cast for both
        if self.convs:
            old = cache.conv if cache is not None and cache.conv is not None else (None, None, None)
            (q, sq), (k, sk), (v, sv) = (conv(t, s) for conv, t, s in zip((self.q_conv, self.k_conv, self.v_conv), (q, k, v), old))
            if cache is not None:
                cache.set_conv((sq, sk, sv))
        q, k, v = q.view(B, T, H, D), k.view(B, T, H, D), v.view(B, T, H, D)  # [B, T, H, D]
        if fused:  # prologue, beta, log decay and the state update in one op; the kernel casts b and a itself
            b, a = ba.split(H, dim=-1)  # [B, 1, H] x2, views
            return self._fused_decode(q, k, v, b, a, cos, sin, cache)  # [B, 1, H, D]
        # q/k norm + RoPE + l2-norm in one op (hybrid.ops.prologue: one Triton kernel on CUDA, else PyTorch)
        norm = self.q_norm is not None
        q, k = gdn_qk_prologue(q, k, self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                               cos, sin, eps=self.q_norm.eps if norm else 1e-6, norm=norm,
                               backend=self.prologue_backend)  # [B, T, H, D] each, unit norm
        # one dtype for the kernel: under bf16 autocast the q/k norms run in float32 while v is bf16 (fla needs one)
        q, k = q.to(v.dtype), k.to(v.dtype)  # [B, T, H, D]
        beta = torch.sigmoid(acc(self.b_proj(x) if b is None else b)).to(v.dtype)  # [B, T, H]
        g = self.log_decay(x, a)  # [B, T, H]
        o, state = gated_delta_rule(q, k, v, g, beta, scale=D ** -0.5,
                                    initial_state=cache.state if cache is not None else None,
                                    output_final_state=cache is not None, use_qk_l2norm_in_kernel=False,
                                    backend=self.backend, fold_heads=self.fold_heads)
        if cache is not None:
            cache.set_state(state)  # [B, H, D, D] (in place when the cache is preallocated)
        return o  # [B, T, H, D]

    def _fused_step(self, per_row: bool, T: int) -> bool:
        """Whether this call takes the fused decode op: ``decode_backend == "fused"``, a per-row static cache with
        fused projections (``per_row``) and one token per row. Other calls (prefill, training, a growing
        HybridCache) keep the split path. ``fold_heads`` does not matter there (the kernel is not tuned per head
        count) and the short convs run before it."""
        if self.decode_backend not in DECODE_BACKENDS:
            raise ValueError(f"GatedDeltaNetBranch.decode_backend must be one of {DECODE_BACKENDS}, got "
                             f"{self.decode_backend!r}; switch with "
                             "hybrid.layers.hybrid_attention.use_fused_decode(model)")
        return self.decode_backend == "fused" and per_row and T == 1

    def _fused_decode(self, q, k, v, b, a, cos, sin, cache) -> torch.Tensor:
        """q, k, v [B, 1, H, D], b, a [B, 1, H] -> o [B, 1, H, D]; ``cache.state`` [B, H, D, D] stepped in place."""
        from hybrid.ops.gdn_decode import gdn_decode_step

        norm = self.q_norm is not None
        decay = dict(A_log=self.A_log, dt_bias=self.dt_bias) if self.decay == "gdn" else dict(a_bias=self.a_bias)
        return gdn_decode_step(q, k, v, b, a, cache.state, self.q_norm.weight if norm else None,
                               self.k_norm.weight if norm else None, cos, sin, eps=self.q_norm.eps if norm else 1e-6,
                               norm=norm, decay=self.decay, scale=self.head_dim ** -0.5, **decay)


def _upgrade_state_dict(state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: keys under ``<prefix>fusion.`` (the merge's older name) move to ``<prefix>merge.``."""
    old = f"{prefix}{FORMER_NAME}."
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[f"{prefix}merge.{key[len(old):]}"] = state_dict.pop(key)


class HybridAttention(nn.Module):
    """One layer's mixer: FA heads + GDN heads -> HeadMerge -> o_proj (teacher's, unchanged).

    A state dict that names the merge by its older name (``fusion.gamma``, ``fusion.head_gate.weight``, ...: an
    older checkpoint) loads as well (``_upgrade_state_dict``)."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        opts = config.options
        self.layer_idx = layer_idx
        H, D, C = config.num_attention_heads, config.head_dim, config.hidden_size
        self.fa_heads, self.la_heads = list(config.fa_heads[layer_idx]), config.la_heads(layer_idx)
        self.fa = (FullAttentionBranch(config, self.fa_heads, rope=opts.fa_rope, log_scale=opts.fa_log_scale,
                                       gate=opts.fa_gate) if self.fa_heads else None)
        self.la = GatedDeltaNetBranch(config, self.la_heads) if self.la_heads else None
        self.merge = HeadMerge(C, H, D, self.fa_heads, opts.merge, opts.gamma_init, opts.norm_eps)
        self.o_proj = nn.Linear(H * D, C, bias=config.o_bias)
        self._register_load_state_dict_pre_hook(_upgrade_state_dict)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]."""
        proj_fa = proj_la = None
        B, T, _ = x.shape
        per_row = cache is not None and getattr(cache, "per_row", False) and cache.fuse_projections
        if self.fa is not None and self.la is not None and self.la.one_matmul(per_row, B, T):
            # decoding: both branches' projections as ONE matmul (common.fused_linear), each reading its slices
            fa_lins = self.fa.decode_linears()
            outs = fused_linear(self, "fa_la_in", fa_lins + self.la.decode_linears(), x,
                                groups=(1,) * len(fa_lins) + self.la.DECODE_GROUPS)  # [B, T, N_i] each
            proj_fa, proj_la = outs[:len(fa_lins)], outs[len(fa_lins):]
        o_fa = self.fa(x, positions, cos, sin, cache, proj_fa) if self.fa is not None else None  # [B, T, H_F, D]
        o_la = self.la(x, positions, cos, sin, cache, proj_la) if self.la is not None else None  # [B, T, H_L, D]
        return self.merge.project(x, o_fa, o_la, self.o_proj)  # [B, T, C] = o_proj(merge(...)), no [B, T, H*D] copy

    def reset_new_parameters(self) -> None:
        for m in (self.fa, self.la, self.merge):
            if m is not None:
                (m.reset_new_parameters if hasattr(m, "reset_new_parameters") else m.reset_parameters)()


def use_fused_decode(model, on: bool = True) -> int:
    """Switch every GDN branch of ``model`` to the fused decode op (``on``) or back to the split path; returns
    how many branches were switched. The fused op runs only for per-row static-cache steps of one token per row
    (``hybrid.decoding.Decoder``); prefill and training keep the split path either way."""
    n = 0
    for m in model.modules():
        if isinstance(m, GatedDeltaNetBranch):
            m.decode_backend = "fused" if on else "split"
            n += 1
    return n
