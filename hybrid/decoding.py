"""Fast decoding: a preallocated mixed cache with per-row lengths, ragged prefill, and a CUDA-graph decode step.

    cache, logits = prefill(model, [ids_a, ids_b], max_new_tokens=32)    # ragged prompts, one row each
    dec = Decoder(model, cache, cuda_graph=None)                          # None: on for CUDA, off on the CPU
    logits = dec.step(next_ids)                                           # next_ids [B, 1] -> logits [B, V]
    tokens = greedy_decode(model, [ids_a, ids_b], max_new_tokens=32)      # [B, N] (the two above in a loop)

``StaticHybridCache`` (a ``HybridCache``) holds, per layer, the FA heads' KV heads in a buffer
[B, S_max, K_F, D] written in place at each row's own positions, the GDN state [B, H_L, D, D] (float32;
float64 for a float64 model) and the conv states, all allocated once. ``lengths`` [B] (on the device, and
mirrored on the host) is the number of positions each row holds. A step of T new tokens per row computes the
positions [B, T], RoPE cos/sin [B, T, D] and the key mask [B, T, S] once for all layers (causal per row, so
the rows' unused tail is masked: the key-padding mask of ragged rows); each branch computes its projections
with one matmul on concatenated weights (``fuse_projections``: a weight copy built at the first step, kept on
the branch until a weight changes); the FA branch writes k/v with one ``index_put_`` and attends with grouped-query SDPA (no KV copy); the GDN branch steps its state (fla's fused
recurrent kernel on CUDA, ``hybrid.ops.gated_delta_rule`` "auto"). Nothing per layer grows with the context in
Python, and no step reads a device value on the host, so the step can be captured as a CUDA graph: then every
step attends over the whole buffer (S = S_max, masked), since a graph has fixed shapes; eagerly S = the
longest row so far.

Rows are prefilled one at a time (``prefill``: an ordinary forward with a ``HybridCache`` per prompt, copied
into the row), so no pad token ever enters a GDN state. Token-level baselines keep every position (their
window is applied by the mask), not a ring buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from hybrid.cache import HybridCache, LayerCache
from hybrid.layers.common import trusted_inference_caches
from hybrid.ops.utils import dependent_launch, pdl_supported

__all__ = ["StaticLayerCache", "StaticHybridCache", "Decoder", "compile_kwargs", "prefill", "greedy_decode",
           "sample_next", "sample_decode"]


@dataclass
class _Step:
    """What one forward step shares across layers (set by StaticHybridCache.begin_step)."""

    positions: torch.Tensor | None = None  # [B, T] absolute positions of the new tokens
    rows: torch.Tensor | None = None  # [B, T] row index of each new token
    mask: torch.Tensor | None = None  # [B, T, S] key j visible to query (b, t): j <= positions[b, t]
    kv_len: torch.Tensor | None = None  # [B] keys the last new token of each row sees (positions[:, -1] + 1)
    S: int = 0  # keys attended: buffer rows 0..S-1
    windowed: dict = field(default_factory=dict)  # per-step values shared by layers: window masks, log scales

    def log_scale(self, base: float, dtype: torch.dtype) -> torch.Tensor:
        """The FA branch's log-length query scale of the new positions [B, T], once per step and base."""
        key = ("log_scale", base, dtype)
        if key not in self.windowed:
            from hybrid.layers.common import log_length_scale

            self.windowed[key] = log_length_scale(self.positions, base).to(dtype)  # [B, T]
        return self.windowed[key]

    def window_mask(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        if window not in self.windowed:
            j = torch.arange(self.S, device=self.mask.device)  # [S]
            self.windowed[window] = self.mask & (j > self.positions[..., None] - window)  # [B, T, S]
        return self.windowed[window]


@dataclass
class StaticLayerCache(LayerCache):
    """A LayerCache whose tensors are preallocated and updated in place (see the module docstring)."""

    step: _Step | None = None
    per_row = True
    fuse_projections: bool = True  # StaticHybridCache.fuse_projections (set for all layers there)

    def write_rows(self, k: torch.Tensor, v: torch.Tensor, window: int | None = None):
        """k, v [B, T, K_F, D] -> (keys, values [B, S, K_F, D] views of the buffer, mask [B, T, S])."""
        st = self.step
        self.keys.index_put_((st.rows, st.positions), k)
        self.values.index_put_((st.rows, st.positions), v)
        return self.keys[:, :st.S], self.values[:, :st.S], st.window_mask(window)

    def append_kv(self, k, v, keep=None):  # pragma: no cover - the FA branch uses write_rows for this cache
        raise RuntimeError("StaticLayerCache is written by write_rows (per-row positions), not append_kv")

    def set_state(self, state: torch.Tensor) -> None:
        self.state.copy_(state)

    def set_conv(self, conv: tuple[torch.Tensor, ...]) -> None:
        for dst, src in zip(self.conv, conv):
            dst.copy_(src)


class StaticHybridCache(HybridCache):
    """Preallocated mixed cache with per-row lengths; build it with ``StaticHybridCache.allocate``."""

    per_row = True

    def __init__(self, layers: list[StaticLayerCache], lengths: torch.Tensor, capacity: int,
                 inv_freq: torch.Tensor, rope_scaling: float) -> None:
        super().__init__(layers=layers, seen_tokens=0)
        self.lengths = lengths  # [B] long, on the device
        self.host_lengths = [0] * lengths.shape[0]  # the same numbers on the host (no sync to read them)
        self.capacity = capacity
        self.inv_freq, self.rope_scaling = inv_freq, rope_scaling  # [D/2] on the device
        self.full_width = False  # True: attend over all `capacity` rows (fixed shapes, for CUDA graphs)
        self.step = _Step()
        for layer in layers:
            layer.step = self.step

    @classmethod
    def allocate(cls, model, batch: int, capacity: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> "StaticHybridCache":
        """Zeroed buffers for ``batch`` rows of up to ``capacity`` positions each (prompt + new tokens)."""
        if batch < 1 or capacity < 1:
            raise ValueError(f"batch={batch} and capacity={capacity} must both be >= 1")
        p = next(model.parameters())
        dtype, device = dtype or p.dtype, device or p.device
        inner = getattr(model, "model", model)
        cfg = inner.config
        D = cfg.head_dim
        st_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        layers = []
        for layer in inner.layers:
            attn = layer.self_attn
            fa = getattr(attn, "fa", None) or getattr(attn, "swa", None)
            la = attn.la
            kf = fa.n_kv if fa is not None else 0
            hl = la.n_heads if la is not None else 0
            lc = StaticLayerCache()
            if kf:
                lc.keys = torch.zeros(batch, capacity, kf, D, dtype=dtype, device=device)  # [B, S, K_F, D]
                lc.values = torch.zeros_like(lc.keys)
            if hl:
                lc.state = torch.zeros(batch, hl, D, D, dtype=st_dtype, device=device)  # [B, H_L, D, D]
                if la.convs:
                    W = la.q_conv.kernel
                    lc.conv = tuple(torch.zeros(batch, W - 1, hl * D, dtype=dtype, device=device) for _ in range(3))
            layers.append(lc)
        inv_freq, scaling = inner.rotary_emb.inv_freq()
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(layers, lengths, capacity, inv_freq.to(device), scaling)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def fuse_projections(self) -> bool:
        """Steps on this cache compute each branch's projections as one matmul on concatenated weights
        (``hybrid.layers.common.fused_linear``: fewer kernels per step; the same dot products, whose summation
        order a BLAS may change in the last bit). Default True; set False for the separate Linears."""
        return all(l.fuse_projections for l in self.layers)

    @fuse_projections.setter
    def fuse_projections(self, on: bool) -> None:
        for l in self.layers:
            l.fuse_projections = bool(on)

    # ---- one forward step (called by HybridModel.forward) --------------------------------
    def begin_step(self, T: int, dtype: torch.dtype):
        """Positions [B, T], cos/sin [B, T, D] of the next T tokens of every row; sets the shared key mask."""
        longest = max(self.host_lengths) + T
        if longest > self.capacity:
            raise ValueError(f"StaticHybridCache: a row would hold {longest} positions but capacity is "
                             f"{self.capacity}; allocate a larger cache")
        dev = self.lengths.device
        st = self.step
        st.positions = self.lengths[:, None] + torch.arange(T, device=dev)  # [B, T]
        st.rows = torch.arange(self.batch, device=dev)[:, None].expand(self.batch, T)  # [B, T]
        st.S = self.capacity if self.full_width else longest
        st.mask = torch.arange(st.S, device=dev) <= st.positions[..., None]  # [B, T, S]
        st.kv_len = st.positions[:, -1] + 1  # [B]
        st.windowed = {}
        freqs = st.positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        cos, sin = (emb.cos() * self.rope_scaling).to(dtype), (emb.sin() * self.rope_scaling).to(dtype)
        return st.positions, cos, sin

    def end_step(self, T: int) -> None:
        self.lengths += T
        self.host_lengths = [n + T for n in self.host_lengths]
        self.seen_tokens = max(self.host_lengths)

    # ---- filling rows --------------------------------------------------------------------
    def load_row(self, row: int, cache: HybridCache, src_row: int = 0) -> None:
        """Copy row ``src_row`` of a ``HybridCache`` (an ordinary prefill of equal-length prompts) into row ``row``."""
        n = cache.seen_tokens
        if n > self.capacity:
            raise ValueError(f"prompt of {n} positions does not fit capacity {self.capacity}")
        for dst, src in zip(self.layers, cache.layers):
            if src.keys is not None:
                a = src.key_start
                dst.keys[row, a:a + src.keys.shape[1]] = src.keys[src_row]
                dst.values[row, a:a + src.values.shape[1]] = src.values[src_row]
            if src.state is not None:
                dst.state[row] = src.state[src_row]
            if src.conv is not None:
                for d, s in zip(dst.conv, src.conv):
                    d[row] = s[src_row]
        self.lengths[row] = n
        self.host_lengths[row] = n
        self.seen_tokens = max(self.host_lengths)

    def load_rows(self, rows: Sequence[int], cache: HybridCache) -> None:
        """``load_row`` for several rows at once: row ``rows[j]`` <- row j of ``cache`` (an ordinary prefill of
        ``len(rows)`` equal-length prompts), one copy per tensor instead of one per row."""
        n, k = cache.seen_tokens, len(rows)
        if n > self.capacity:
            raise ValueError(f"prompt of {n} positions does not fit capacity {self.capacity}")
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.lengths.device)  # [k]
        for dst, src in zip(self.layers, cache.layers):
            if src.keys is not None:
                a = src.key_start
                S = src.keys.shape[1]
                dst.keys[idx, a:a + S] = src.keys[:k].to(dst.keys.dtype)  # [k, S, K_F, D]
                dst.values[idx, a:a + S] = src.values[:k].to(dst.values.dtype)
            if src.state is not None:
                dst.state[idx] = src.state[:k].to(dst.state.dtype)  # [k, H_L, D, D]
            if src.conv is not None:
                for d, c in zip(dst.conv, src.conv):
                    d[idx] = c[:k].to(d.dtype)  # [k, W-1, H_L*D]
        self.lengths[idx] = n
        for r in rows:
            self.host_lengths[r] = n
        self.seen_tokens = max(self.host_lengths)

    def snapshot(self) -> dict:
        """The parts a step changes besides KV rows past each length (states, conv states, lengths)."""
        return dict(lengths=self.lengths.clone(), host=list(self.host_lengths),
                    states=[None if l.state is None else l.state.clone() for l in self.layers],
                    convs=[None if l.conv is None else tuple(c.clone() for c in l.conv) for l in self.layers])

    def restore(self, snap: dict) -> None:
        self.lengths.copy_(snap["lengths"])
        self.host_lengths = list(snap["host"])
        self.seen_tokens = max(self.host_lengths)
        for l, s, c in zip(self.layers, snap["states"], snap["convs"]):
            if s is not None:
                l.state.copy_(s)
            if c is not None:
                for d, x in zip(l.conv, c):
                    d.copy_(x)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("StaticHybridCache does not reorder rows (beam search): use HybridCache")


@torch.no_grad()
def prefill(model, prompts: Sequence[torch.Tensor], max_new_tokens: int, capacity: int | None = None,
            group: int = 1, cache: StaticHybridCache | None = None):
    """Prefill each prompt (1-d token ids, any lengths) into its own row of a new StaticHybridCache.

    ``group`` > 1: prompts of the same length go through one forward, up to ``group`` at a time (no padding,
    so the result is the per-prompt prefill's up to the batched matmuls' rounding). ``cache``: fill this
    StaticHybridCache instead of allocating one (one row per prompt; every row is overwritten, and what a row
    held past its new length is masked); a captured ``Decoder`` on it replays on the new rows. Returns (cache,
    logits [B, V] of each prompt's last position)."""
    if not prompts:
        raise ValueError("prefill needs at least one prompt")
    for i, p in enumerate(prompts):
        if p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-d tensor of token ids, got shape {tuple(p.shape)}")
    need = max(p.numel() for p in prompts) + max_new_tokens
    if cache is None:
        cache = StaticHybridCache.allocate(model, len(prompts), capacity or need)
    elif cache.batch != len(prompts) or cache.capacity < need:
        raise ValueError(f"prefill: the given cache holds {cache.batch} rows of {cache.capacity} positions; "
                         f"{len(prompts)} prompts and {need} positions (prompt + max_new_tokens) are needed")
    if group < 1:
        raise ValueError(f"prefill: group={group} must be >= 1")
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(p.numel(), []).append(i)
    last: list[torch.Tensor | None] = [None] * len(prompts)
    for rows in by_len.values():
        for a in range(0, len(rows), group):
            chunk = rows[a:a + group]
            ids = torch.stack([prompts[i] for i in chunk])  # [b, P]
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache.load_rows(chunk, out.hybrid_cache)
            for j, i in enumerate(chunk):
                last[i] = out.logits[j, -1]  # [V]
            del out
    return cache, torch.stack(last)  # [B, V]


def _raise_recompile_limit(n: int) -> None:
    """dynamo's per-code-object recompile limit raised to at least ``n`` (never lowered). The layers of a
    compiled step share their code objects: a graph break inside them makes one compiled variant per distinct
    layer (its guards read each layer's heads) and per cache shape, and past the limit (8 by default) the
    remaining variants would run eagerly without a word."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, name) < n:
        setattr(cfg, name, n)
    acc = "accumulated_recompile_limit" if hasattr(cfg, "accumulated_recompile_limit") else None
    if acc is not None and getattr(cfg, acc) < 2 * n:
        setattr(cfg, acc, 2 * n)


def compile_kwargs(backend: str = "inductor", mode: str = "default", options: dict | None = None) -> dict:
    """``torch.compile``'s ``mode`` / ``options`` for a compiled decode step. torch.compile takes one or the other:
    with ``options`` (inductor's settings by name, e.g. ``{"combo_kernels": True}``: independent small kernels of
    the step launched as one), the mode's own settings (``torch._inductor.list_mode_options``) are merged under
    them. An unknown setting, or settings for another backend, are refused here, before any compile."""
    if not options:
        return {"mode": mode} if backend == "inductor" else {}
    if backend != "inductor":
        raise ValueError(f"compile_options are inductor's settings; compile_backend={backend!r} takes none: drop "
                         "them or use the inductor backend")
    from torch._inductor import config, list_mode_options

    known = config.get_config_copy()
    unknown = sorted(set(options) - set(known))
    if unknown:
        near = sorted(k for k in known if any(u.split(".")[-1] in k for u in unknown))[:5]
        raise ValueError(f"compile_options: {unknown} are not torch._inductor.config settings"
                         + (f" (near: {near})" if near else "") + "; e.g. combo_kernels, coordinate_descent_tuning")
    try:
        base = list_mode_options(mode)
    except Exception as err:  # an unknown mode
        raise ValueError(f"compile_mode={mode!r}: {err}") from None
    return {"options": {**base, **options}}


def inductor_pdl_options() -> dict:
    """Inductor's PDL setting for a compiled step, where this torch has it (``triton.enable_pdl``), else none."""
    from torch._inductor import config

    return {"triton.enable_pdl": True} if "triton.enable_pdl" in config.get_config_copy() else {}


class Decoder:
    """Decode steps of one token per row on a StaticHybridCache, optionally replayed as a CUDA graph.

    ``cuda_graph``: None (default) = on when the cache is on CUDA, off otherwise; True on the CPU is an error.
    The graph is captured at the first step (after ``warmup`` eager steps whose effects are undone), and
    attends over the whole buffer (fixed shapes).

    ``compile``: ``torch.compile`` the step (``compile_mode``, e.g. "max-autotune-no-cudagraphs", and
    ``compile_backend``, "inductor"; ``compile_options``, inductor's settings by name on top of the mode's, e.g.
    ``{"combo_kernels": True}``, see ``compile_kwargs``; ``dynamic=False``; with the graph, the warm-up
    steps compile it and the graph captures the compiled kernels). A compiled step always attends over the
    whole buffer (fixed shapes: one compilation for every step) and its compiled code sees constant host
    lengths (the Decoder keeps the real ones), so steps do not recompile. The decode weight caches
    (``hybrid.layers.common.fused_linear``, ``inference_constant``) are made by one eager step, undone, before the
    first compiled one (``prime``), and read by the compiled step without a check (``trusted_inference_caches``),
    so they break no graph. On CUDA the decode path's Triton / fla kernels (the split-KV decode attention, the q/k
    prologue's forward, fla's recurrent step, the fused GDN step) are ``torch.library`` custom ops
    (``torch.ops.hybrid.*``), each one node of the step's one graph, and the availability checks are constants
    under compile, so the step compiles to one graph (docs/kernels.md). Off by default.

    ``fused_gdn``: True switches every GDN branch of ``model`` to the fused decode op (``hybrid.ops.gdn_decode``:
    q/k prologue, gates and state update in one Triton kernel on CUDA), False back to the split ops; the switch
    stays on the model. None (default) leaves the model as it is (split unless switched). Off by default until
    its GPU parity test and kernel count have run (docs/kernels.md).

    ``pdl``: programmatic dependent launch on a GPU of compute capability 9.0 or later: every step (and the CUDA
    graph's capture) runs inside ``hybrid.ops.utils.dependent_launch()``, so the project's decode kernels (split-KV
    attention, its combine, the fused GDN step) launch while the kernel before them ends, and a compiled step's
    Triton kernels do the same (inductor's ``triton.enable_pdl``, added to ``compile_options`` where this torch has
    it). Elsewhere it changes nothing. Off by default until its GPU parity test and timing have run."""

    def __init__(self, model, cache: StaticHybridCache, cuda_graph: bool | None = None, warmup: int = 2,
                 compile: bool = False, compile_mode: str = "default", compile_backend: str = "inductor",
                 fused_gdn: bool | None = None, compile_options: dict | None = None, pdl: bool = False) -> None:
        on_cuda = cache.lengths.is_cuda
        self.pdl = bool(pdl) and pdl_supported(cache.lengths)
        if self.pdl and compile and compile_backend == "inductor":
            compile_options = {**inductor_pdl_options(), **(compile_options or {})}  # the caller's setting wins
        compile_args = compile_kwargs(compile_backend, compile_mode, compile_options)  # checked before any work
        if cuda_graph and not on_cuda:
            raise ValueError("cuda_graph=True needs the model and cache on a CUDA device; use cuda_graph=False "
                             "(or None) on the CPU")
        if fused_gdn is not None:
            from hybrid.layers.hybrid_attention import use_fused_decode

            use_fused_decode(model, bool(fused_gdn))
        self.model, self.cache = model, cache
        self.use_graph = on_cuda if cuda_graph is None else bool(cuda_graph)
        self.warmup = warmup
        self.graph = None
        self.ids = None  # [B, 1] static input of the graph
        self.logits = None  # [B, V] static output of the graph
        self.compiled = None
        self._primed = False  # the eager step before the first compiled one has run
        if compile:
            cache.full_width = True  # fixed shapes: S = capacity at every step
            _raise_recompile_limit(4 * len(getattr(getattr(model, "model", model), "layers", ())) + 8)
            self.compiled = torch.compile(self._model_step, backend=compile_backend, dynamic=False, **compile_args)

    def _model_step(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, hybrid_cache=self.cache, use_cache=True).logits[:, -1]  # [B, V]

    @torch.no_grad()
    def prime(self, ids: torch.Tensor) -> None:
        """One eager step, undone (the cache as before): it makes the decode weight caches that a compiled step
        reads inside ``trusted_inference_caches()``."""
        snap = self.cache.snapshot()
        self._model_step(ids)
        self.cache.restore(snap)
        self._primed = True

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.compiled is None:
            return self._model_step(ids)  # [B, V]
        cache = self.cache
        host, seen = cache.host_lengths, cache.seen_tokens
        if max(host) + 1 > cache.capacity:
            raise ValueError(f"StaticHybridCache is full (capacity {cache.capacity})")
        if not self._primed:
            self.prime(ids)
        # the compiled code reads host numbers for begin_step's capacity check (done above), the key count (the
        # capacity here) and "is this a first step" (never): constants, so its guards hold at every step
        cache.host_lengths, cache.seen_tokens = [0] * cache.batch, 1
        try:
            with trusted_inference_caches():  # made by the eager step above, for these parameters
                logits = self.compiled(ids)  # [B, V]
        except BaseException:
            cache.host_lengths, cache.seen_tokens = host, seen
            raise
        cache.host_lengths = [n + 1 for n in host]
        cache.seen_tokens = max(cache.host_lengths)
        return logits

    def _capture(self, ids: torch.Tensor) -> None:
        cache = self.cache
        cache.full_width = True
        self.ids = ids.clone()
        snap = cache.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (autotuning, allocator) off the capture stream, then undone
            for _ in range(self.warmup):
                self._forward(self.ids)
                cache.restore(snap)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward(self.ids)
        cache.restore(snap)  # capture ran end_step's host part once; the device part was only recorded

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, 1] (one new token per row) -> logits [B, V]; advances every row by one position."""
        with dependent_launch(self.pdl):
            return self._step(ids)

    def _step(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape != (self.cache.batch, 1):
            raise ValueError(f"ids must be [B, 1] = [{self.cache.batch}, 1], got {tuple(ids.shape)}")
        if not self.use_graph:
            return self._forward(ids)
        if max(self.cache.host_lengths) + 1 > self.cache.capacity:
            raise ValueError(f"StaticHybridCache is full (capacity {self.cache.capacity})")
        if self.graph is None:
            self._capture(ids)
        self.ids.copy_(ids)
        self.graph.replay()
        self.cache.host_lengths = [n + 1 for n in self.cache.host_lengths]
        self.cache.seen_tokens = max(self.cache.host_lengths)
        return self.logits


@torch.no_grad()
def greedy_decode(model, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                  cuda_graph: bool | None = None) -> torch.Tensor:
    """Greedy continuation of ragged prompts, batched: returns the new tokens [B, max_new_tokens]."""
    cache, logits = prefill(model, prompts, max_new_tokens)
    dec = Decoder(model, cache, cuda_graph=cuda_graph)
    out = []
    nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
    for i in range(max_new_tokens):
        out.append(nxt)
        if i + 1 < max_new_tokens:
            nxt = dec.step(nxt).argmax(-1, keepdim=True)
    return torch.cat(out, 1)  # [B, N]


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from logits [B, V]: temperature, then top-k (0: off), then nucleus top-p; temperature 0
    is greedy, and so is a nucleus of one token (ties go to the lowest index, as in argmax). Returns [B, 1]."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)  # [B, 1]
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"sample_next: temperature={temperature} must be >= 0, top_p={top_p} in (0, 1], "
                         f"top_k={top_k} >= 0")
    x = logits.float() / temperature  # [B, V]
    if top_k and top_k < x.shape[-1]:
        kth = x.topk(top_k, -1).values[:, -1:]  # [B, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1:
        srt, idx = x.sort(dim=-1, descending=True, stable=True)  # [B, V]; ties in index order, as argmax breaks them
        p = srt.softmax(-1)
        drop = p.cumsum(-1) - p > top_p  # [B, V] tokens past the nucleus (the first one is always kept)
        x = x.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)  # [B, V]
    return torch.multinomial(probs, 1, generator=generator)  # [B, 1]


@torch.no_grad()
def sample_decode(model, prompts: Sequence[torch.Tensor], max_new_tokens: int, *, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = 0, stop_ids: Sequence[int] = (),
                  generator: torch.Generator | None = None, cuda_graph: bool | None = None,
                  prefill_group: int = 64, check_every: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled continuation of ragged prompts, batched (``sample_next`` per step; temperature 0 = greedy).

    Returns (tokens [B, N], counts [B]): row b's answer is tokens[b, :counts[b]], ending with its first stop
    token when it met one (what follows is filler). Stops early once every row has met a stop token (checked
    on the host every ``check_every`` steps)."""
    cache, logits = prefill(model, prompts, max_new_tokens, group=prefill_group)
    dec = Decoder(model, cache, cuda_graph=cuda_graph)
    B, dev = len(prompts), logits.device
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=dev)  # [n_stop]
    done = torch.zeros(B, dtype=torch.bool, device=dev)  # [B]
    counts = torch.full((B,), max_new_tokens, dtype=torch.long, device=dev)  # [B]
    out = []
    nxt = sample_next(logits, temperature, top_p, top_k, generator)  # [B, 1]
    for i in range(max_new_tokens):
        out.append(nxt)
        if stops.numel():
            hit = torch.isin(nxt[:, 0], stops) & ~done  # [B]
            counts = torch.where(hit, i + 1, counts)
            done |= hit
            if (i + 1) % check_every == 0 and bool(done.all()):
                break
        if i + 1 < max_new_tokens:
            nxt = sample_next(dec.step(nxt), temperature, top_p, top_k, generator)
    tokens = torch.cat(out, 1)  # [B, n <= N]
    return tokens, counts.clamp(max=tokens.shape[1])
