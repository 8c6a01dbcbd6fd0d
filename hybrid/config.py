"""Configuration of a head-level FA/GDN hybrid.

Two objects:
- ``HybridOptions``: a frozen dataclass of the hybrid's design switches (FA branch, GDN branch,
  branch merge, granularity, validation policy), validated in ``__post_init__``.
- ``HybridConfig``: the ``transformers`` config (model_type ``"headscope_hybrid"``) that stores the
  teacher's architecture fields, the per-layer FA head lists and the options (as a plain dict), so
  ``save_pretrained`` / ``from_pretrained`` round-trip through ``config.json``.

Nothing is registered with ``AutoConfig`` on import; call ``hybrid.register()`` (``from_mask`` and
``HybridForCausalLM.from_pretrained`` do it for you).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from transformers import PretrainedConfig

from headscope.configs import from_dict
from hybrid.layers.merge import FORMER_NAME, MERGES

__all__ = ["HybridOptions", "HybridConfig", "HybridConfigError", "GRANULARITIES", "MERGES", "upgrade_options"]

GRANULARITIES = ("head", "layer", "token")
FA_GATES = ("sigmoid2", "none")
FA_NOPE_INITS = ("copy", "rope_mean")  # hybrid.convert: how a NoPE FA head's queries start from the teacher's
DECAYS = ("gdn", "simple")
PROLOGUE_BACKENDS = ("auto", "torch", "triton")  # hybrid.ops.prologue.BACKENDS (not imported: config stays light)


class HybridConfigError(ValueError):
    """A hybrid configuration or head mask that cannot build a model."""


def upgrade_options(data: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of the options ``data`` with the key ``fusion`` (the older name, which saved config.json files and
    training configs may use) renamed ``merge``; both keys with different values are refused."""
    out = dict(data or {})
    if FORMER_NAME in out:
        old = out.pop(FORMER_NAME)
        if "merge" in out and out["merge"] != old:
            raise HybridConfigError(f"hybrid options give both merge={out['merge']!r} and its older name "
                                    f"{FORMER_NAME}={old!r}; keep merge only")
        out["merge"] = old
    return out


@dataclass(frozen=True)
class HybridOptions:
    """Design switches of the hybrid (defaults follow docs/method.md section 2; docs/hybrid.md explains each)."""

    granularity: str = "head"  # "head" (mask), "layer" (whole layers), "token" (sliding window + GDN, all heads)
    # FA branch
    fa_rope: bool = False  # keep RoPE on FA heads (False = NoPE, the method's choice)
    fa_log_scale: bool = True  # multiply queries by s_t = log(t + a) / log(a)
    log_scale_base: float = 512.0  # a in s_t
    fa_gate: str = "sigmoid2"  # "sigmoid2": o * 2*sigmoid(W x + b), W=0, b=0 -> exactly 1 at init; "none"
    # NoPE FA heads' queries at conversion: "copy" (the teacher's rows) or "rope_mean" (each rotary pair mapped by
    # the teacher's RoPE rotation averaged over the causal pairs of a fa_nope_init_length-token context)
    fa_nope_init: str = "copy"
    fa_nope_init_length: int = 2048
    # partial RoPE on the FA heads (with fa_rope=True): rotate only the frequencies whose wavelength 2*pi/theta is at
    # most this many positions (the fast ones, which turn through every phase within it); the slower ones carry no
    # position, as NoPE. None: every frequency (the teacher's heads exactly)
    fa_rope_max_wavelength: float | None = None
    # GDN branch
    gdn_conv: bool = False  # short causal depthwise conv on q, k, v (initialised to identity)
    conv_size: int = 4
    decay: str = "gdn"  # "gdn": g = -exp(A_log) * softplus(a_proj(x) + dt_bias); "simple": g = logsigmoid(a_proj(x) + bias)
    gdn_backend: str = "auto"  # passed to hybrid.ops.gated_delta_rule
    gdn_fold_heads: bool = False  # GDN heads folded into the batch: one fla kernel tuning for all head counts
    attn_backend: str = "auto"  # passed to hybrid.ops.attention
    prologue_backend: str = "auto"  # GDN q/k norm + RoPE + l2norm: hybrid.ops.prologue ("auto", "torch", "triton")
    # token-level baseline
    window: int = 512  # sliding window of the token-level baseline (keys per query, incl. itself)
    # merge of the branches' head outputs before o_proj (config.json of older saves: "fusion", read as "merge")
    merge: str = "norm"  # a name in hybrid.layers.merge.MERGES: "norm", "none", "gated_head", "gated_branch"
    gamma_init: float = 1.0  # before calibrate_merge(); see docs/hybrid.md
    norm_eps: float = 1e-6
    # validation policy
    require_fa_per_layer: bool = False  # error if some layer has no FA head
    allow_degenerate: bool = False  # allow a mask with no FA head (all-GDN) or no GDN head (teacher-like)
    seed: int = 0  # seed of the new parameters' random init (A_log, dt_bias)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise HybridConfigError(f"HybridOptions.{name}={getattr(self, name)!r}: {why}")

        if self.granularity not in GRANULARITIES:
            bad("granularity", f"must be one of {GRANULARITIES}")
        if self.merge == "gated":
            bad("merge", "'gated' was split in two: 'gated_head' (the paper's per-head competition between the "
                         "branches' heads) or 'gated_branch' (the former 'gated': one gate per branch)")
        if self.merge not in MERGES:
            bad("merge", f"must be one of {sorted(MERGES)} (hybrid.layers.merge.MERGES)")
        if self.granularity == "token" and not MERGES[self.merge].token_level:
            bad("merge", f"the token-level baseline supports "
                         f"{sorted(n for n, m in MERGES.items() if m.token_level)} (its heads have no branch "
                         "competition); use one of those with granularity='token'")
        if self.fa_gate not in FA_GATES:
            bad("fa_gate", f"must be one of {FA_GATES}")
        if self.fa_nope_init not in FA_NOPE_INITS:
            bad("fa_nope_init", f"must be one of {FA_NOPE_INITS}")
        if self.fa_nope_init != "copy" and self.fa_rope:
            bad("fa_nope_init", "initialises NoPE FA heads (fa_rope=False); with fa_rope=True the teacher's "
                                "queries are copied as they are: leave it at 'copy'")
        if self.fa_rope_max_wavelength is not None:
            w = self.fa_rope_max_wavelength
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
                bad("fa_rope_max_wavelength", "must be a positive number of positions, or None for every frequency")
            if not self.fa_rope:
                bad("fa_rope_max_wavelength", "keeps RoPE on part of the FA heads' frequencies: it needs "
                                              "fa_rope=True (with fa_rope=False no frequency is rotated)")
        if not isinstance(self.fa_nope_init_length, int) or isinstance(self.fa_nope_init_length, bool) \
                or self.fa_nope_init_length < 1:
            bad("fa_nope_init_length", "must be a positive int (tokens)")
        if self.decay not in DECAYS:
            bad("decay", f"must be one of {DECAYS}")
        if self.prologue_backend not in PROLOGUE_BACKENDS:
            bad("prologue_backend", f"must be one of {PROLOGUE_BACKENDS}")
        if not self.log_scale_base > 1:
            bad("log_scale_base", "must be > 1 (s_t = log(t + a) / log(a))")
        if not isinstance(self.conv_size, int) or self.conv_size < 1:
            bad("conv_size", "must be a positive int")
        if not isinstance(self.window, int) or self.window < 1:
            bad("window", "must be a positive int (keys per query)")
        if not self.norm_eps > 0:
            bad("norm_eps", "must be > 0")
        if not self.gamma_init > 0:
            bad("gamma_init", "must be > 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "HybridOptions":
        """The options of ``data`` (a config.json's ``hybrid`` table, a TOML ``[hybrid]`` table, keyword arguments);
        the older name ``fusion`` of ``merge`` is read as ``merge``."""
        return from_dict(cls, upgrade_options(data), where="hybrid options", error=HybridConfigError,
                         unknown_text="unknown hybrid option(s)")


class HybridConfig(PretrainedConfig):
    """Config of ``HybridForCausalLM``: the teacher's shape, the FA heads per layer, and the options.

    ``fa_heads[l]`` lists the query heads of layer ``l`` that keep full attention; all other heads of the
    layer are Gated DeltaNet heads (ignored for ``granularity="token"``, where every head has both).
    """

    model_type = "headscope_hybrid"

    def __init__(self, vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 128,
                 num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int | None = None,
                 head_dim: int | None = None, hidden_act: str = "silu", rms_norm_eps: float = 1e-6,
                 max_position_embeddings: int = 4096, rope_parameters: dict | None = None,
                 qk_norm: bool = False, qkv_bias: bool = False, o_bias: bool = False, mlp_bias: bool = False,
                 initializer_range: float = 0.02, base_model_type: str | None = None,
                 fa_heads: Sequence[Sequence[int]] | None = None, hybrid: dict | None = None,
                 tie_word_embeddings: bool = False, use_cache: bool = True, **kwargs: Any) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        self.qk_norm = qk_norm
        self.qkv_bias = qkv_bias
        self.o_bias = o_bias
        self.mlp_bias = mlp_bias
        self.initializer_range = initializer_range
        self.base_model_type = base_model_type
        self.fa_heads = [sorted(int(h) for h in layer) for layer in fa_heads] if fa_heads is not None else None
        self.hybrid = HybridOptions.from_dict(hybrid).to_dict()  # validates
        self.use_cache = use_cache
        if self.head_dim is None:
            if hidden_size % num_attention_heads:
                raise HybridConfigError(
                    f"HybridConfig: hidden_size={hidden_size} is not divisible by num_attention_heads="
                    f"{num_attention_heads}; pass head_dim explicitly")
            self.head_dim = hidden_size // num_attention_heads
        if self.head_dim <= 0 or self.head_dim % 2:
            raise HybridConfigError(f"HybridConfig: head_dim={self.head_dim} must be a positive even number "
                                    "(RoPE rotates pairs of channels)")
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        if self.fa_heads is None:  # a bare HybridConfig() (transformers builds one to diff against): no checks
            self.fa_heads = [[] for _ in range(num_hidden_layers)]
        else:
            self.validate_hybrid()

    # ---- derived views -------------------------------------------------------------------
    @property
    def options(self) -> HybridOptions:
        return HybridOptions.from_dict(self.hybrid)

    @property
    def n_rep(self) -> int:
        """Query heads per KV head in the teacher (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    def la_heads(self, layer: int) -> list[int]:
        fa = set(self.fa_heads[layer])
        return [h for h in range(self.num_attention_heads) if h not in fa]

    def fa_kv_heads(self, layer: int) -> list[int]:
        """Teacher KV heads that the FA heads of ``layer`` read (the only ones the FA branch keeps)."""
        return sorted({h // self.n_rep for h in self.fa_heads[layer]})

    # ---- validation ----------------------------------------------------------------------
    def validate_hybrid(self) -> None:
        """Raise HybridConfigError naming the problem when the shape or head lists cannot build a model."""
        H, K, D, L = self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.num_hidden_layers
        opts = self.options
        if H <= 0 or K <= 0 or H % K:
            raise HybridConfigError(
                f"HybridConfig: num_attention_heads={H} must be a positive multiple of num_key_value_heads={K}")
        if D <= 0 or D % 2:
            raise HybridConfigError(f"HybridConfig: head_dim={D} must be a positive even number (RoPE rotates pairs)")
        if len(self.fa_heads) != L:
            raise HybridConfigError(
                f"HybridConfig: fa_heads has {len(self.fa_heads)} layers, the model has num_hidden_layers={L}")
        for l, heads in enumerate(self.fa_heads):
            bad = [h for h in heads if not 0 <= h < H]
            if bad:
                raise HybridConfigError(f"HybridConfig: layer {l} lists FA heads {bad} outside 0..{H - 1}")
            if len(set(heads)) != len(heads):
                raise HybridConfigError(f"HybridConfig: layer {l} lists an FA head twice: {heads}")
        if opts.granularity == "token":
            return
        if opts.granularity == "layer":
            mixed = [l for l, heads in enumerate(self.fa_heads) if 0 < len(heads) < H]
            if mixed:
                raise HybridConfigError(
                    f"granularity='layer' but layers {mixed} mix FA and GDN heads; use granularity='head' "
                    "or a mask from hybrid.layerwise_mask")
        n_fa = sum(len(h) for h in self.fa_heads)
        if not opts.allow_degenerate:
            if n_fa == 0:
                raise HybridConfigError(
                    "the mask keeps no full-attention head (an all-GDN model); pass allow_degenerate=True "
                    "to build this baseline on purpose")
            if n_fa == H * L:
                raise HybridConfigError(
                    "the mask keeps every head as full attention (no GDN head: the teacher); pass "
                    "allow_degenerate=True, or use hybrid.from_teacher(teacher) for the teacher baseline")
        if opts.require_fa_per_layer:
            empty = [l for l in range(L) if not self.fa_heads[l]]
            if empty:
                raise HybridConfigError(
                    f"layers {empty} have no full-attention head but require_fa_per_layer=True; select with "
                    "at least one FA head per layer, or set require_fa_per_layer=False")
