"""Path patching: the sender score of every head through a receiver set R (docs/method.md section 1).

For a clean/corrupted pair, receivers R and a sender s = (l_s, h_s):

1. Sender run: the clean prompt with s's z (its slice of the output projection's input) set to its
   corrupted-run value and every other head's z frozen at its clean value (MLPs and norms recompute).
   Each receiver r = (l_r, h_r) gets z_r' = r's channels of its layer's attention module run on the
   residual input that this run feeds it (only r's q/k/v inputs change; under GQA only r's output is
   taken, even though its KV head is shared).
2. Receiver run: the clean prompt with just the receivers' z set to z_r'; metric M_path(s).
3. S_send(s) = (M_clean - M_path(s)) / (M_clean - M_corrupt).

Senders at layers >= the last receiver layer cannot reach a receiver input: their score is exactly 0
and they are not computed. Receivers at layers <= l_s see their clean input, so z_r' = z_r (clean).

``NaivePathBackend`` (two full forwards per sender, literally as above) is the test oracle.
``HFPathBackend`` is exact and fast, on top of the receiver engine's tricks (patching/hf.py):
- prefix reuse: positions < first_diff are clean in both runs; only the suffix is recomputed;
- senders as batch elements, the sender run starting at the lowest sender layer (earlier layers replay
  their recorded clean output) and stopping (by an exception) right after the last receiver layer's
  attention; in its non-receiver layers attention is frozen to clean anyway, so the attention module's
  forward is replaced by a replay of its recorded clean output (plus o_proj of the patched z on the
  rows whose sender sits in that layer): those layers cost only their MLP;
- in the sender run's receiver layers (also frozen to clean), only the receiver heads' z is needed: for
  Llama-like attention (q_proj/k_proj/v_proj, per-head reshape) a "slim" copy of the attention module
  whose projections keep only the receivers' query heads and their KV heads (one copy per receiver,
  so GQA becomes one KV head per query head) computes them, on the clean prefix KV of those heads;
  other layouts (GPT-2, GPT-NeoX) run the full attention module and take the receivers' channels;
- the receiver run starts at the first receiver layer after the batch's senders (whose input is still
  clean, so its attention output is o_proj of the clean z with the receivers' channels patched: no
  attention computed there), and produces logits at the answer rows only.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn

from headscope.arch import Arch
from headscope.heads import Head
from headscope.metrics import Metric
from headscope.batching import micro_batches
from headscope.hooks import hooks, post, pre, record_inputs
from headscope.patching.engine import NaiveBackend, head_jobs
from headscope.patching.hf import HFBackend, HFFastConfig, _record_layer_outputs, _replay_layers, prefix_kv
from headscope.patching.inputs import PatchPair

__all__ = ["NaivePathBackend", "HFPathBackend", "normalize_receivers", "receiver_table"]


class _StopForward(Exception):
    """Raised inside a forward once everything the sender run needs has been recorded."""


def normalize_receivers(receivers: Any, n_layers: int, n_heads: int) -> tuple[Head, ...]:
    """Receivers as a sorted tuple of distinct in-range heads (Head, (layer, head) or {"layer", "head"})."""
    if isinstance(receivers, (Head, dict)) or (isinstance(receivers, tuple) and len(receivers) == 2
                                              and all(isinstance(x, int) for x in receivers)):
        receivers = [receivers]
    try:
        heads = sorted({Head.from_any(r) for r in receivers})
    except TypeError as err:
        raise TypeError(f"receivers must be a list of heads (Head or (layer, head)), got {receivers!r}") from err
    if not heads:
        raise ValueError("receivers is empty: pass at least one head, e.g. scores.top(5) of the receiver scores")
    bad = [str(h) for h in heads if h.layer >= n_layers or h.head >= n_heads]
    if bad:
        raise ValueError(f"receivers {bad} are outside this model's {n_layers} layers x {n_heads} heads")
    return tuple(heads)


def receiver_table(receivers: Sequence[Head]) -> dict[int, list[int]]:
    """layer -> receiver heads of that layer (sorted)."""
    table: dict[int, list[int]] = {}
    for r in receivers:
        table.setdefault(r.layer, []).append(r.head)
    return {l: sorted(hs) for l, hs in sorted(table.items())}


# ---- the plain oracle ------------------------------------------------------------------------------
class NaivePathBackend(NaiveBackend):
    """Reference: per sender, a full sender run and a full receiver run, exactly as defined.

    z_r' is computed literally: the receiver layer's attention module is called again, after the sender
    run, on the input (and keyword arguments) it received in that run. ``skip_unreachable=False`` also
    computes the senders at layers >= the last receiver layer (whose scores are ~0 up to rounding).
    """

    name = "naive"

    def __init__(self, model: nn.Module, receivers: Any, skip_unreachable: bool = True):
        super().__init__(model)  # model, arch, head counts, device, answer_logits
        self.receivers = normalize_receivers(receivers, self.n_layers, self.n_heads)
        self.table = receiver_table(self.receivers)
        self.last_layer = max(self.table)
        self.skip_unreachable = skip_unreachable

    @contextlib.contextmanager
    def _sender_hooks(self, sender: tuple[int, int], z_clean, z_corrupt) -> Iterator[dict[int, tuple]]:
        """Freeze every z at clean except the sender's (corrupted); record the receiver layers' attention inputs."""
        arch, (ls, hs) = self.arch, sender
        inputs: dict[int, tuple] = {}

        def freeze(l: int):
            def hook(module, args):
                z = z_clean[l].clone()  # [1, T, H*D]
                if l == ls:
                    sl = arch.head_slice(hs)
                    z[:, :, sl] = z_corrupt[l][:, :, sl]
                return (z,) + tuple(args[1:])
            return hook

        def record(l: int):
            def hook(module, args, kwargs):
                inputs[l] = (tuple(a.clone() if torch.is_tensor(a) else a for a in args), dict(kwargs))
            return hook

        with hooks([pre(p, freeze(l)) for l, p in enumerate(arch.out_projs)],
                   [pre(arch.attentions[l], record(l), with_kwargs=True) for l in self.table]):
            yield inputs

    def _receiver_z(self, inputs: dict[int, tuple]) -> dict[tuple[int, int], torch.Tensor]:
        """Run each receiver layer's attention on its recorded input; z_r' = r's channels  # [1, T, D]."""
        out: dict[tuple[int, int], torch.Tensor] = {}
        for l, heads in self.table.items():
            args, kwargs = inputs[l]
            with record_inputs(self.arch.out_projs) as z:  # hooks every layer; only layer l runs here
                self.arch.attentions[l](*args, **kwargs)
            for h in heads:
                out[(l, h)] = z[l][:, :, self.arch.head_slice(h)]
        return out

    @contextlib.contextmanager
    def _receiver_hooks(self, z_recv: dict[tuple[int, int], torch.Tensor]) -> Iterator[None]:
        def make_hook(l: int):
            def hook(module, args):
                z = args[0].clone()  # [1, T, H*D]
                for h in self.table[l]:
                    z[:, :, self.arch.head_slice(h)] = z_recv[(l, h)]
                return (z,) + tuple(args[1:])
            return hook

        with hooks(pre(self.arch.out_projs[l], make_hook(l)) for l in self.table):
            yield

    @torch.inference_mode()
    def patched_metrics(self, pair: PatchPair, metric: Metric, pbar=None,
                        heads: Sequence[Head] | None = None) -> torch.Tensor:
        """M_path of every sender  # [L, H] float64 (M_clean for the unreachable ones when skipped); with
        ``heads``, of those senders only."""
        with record_inputs(self.arch.out_projs) as z_clean:
            m_clean = float(metric(self._logits(pair.clean_ids[None], pair.answer_pos), pair)[0])
        with record_inputs(self.arch.out_projs) as z_corrupt:
            self._logits(pair.corrupt_ids[None], pair.answer_pos)
        out = torch.full((self.n_layers, self.n_heads), m_clean, dtype=torch.float64)  # [L, H]
        for ls, hs in head_jobs(self.n_layers, self.n_heads, heads):
            if ls >= self.last_layer and self.skip_unreachable:
                if pbar is not None:
                    pbar.update(1)
                continue
            with self._sender_hooks((ls, hs), z_clean, z_corrupt) as inputs:
                self._logits(pair.clean_ids[None], pair.answer_pos)
            z_recv = self._receiver_z(inputs)
            with self._receiver_hooks(z_recv):
                logits = self._logits(pair.clean_ids[None], pair.answer_pos)  # [1, A, V]
            out[ls, hs] = metric(logits, pair)[0]
            if pbar is not None:
                pbar.update(1)
        return out


# ---- the fast exact path ---------------------------------------------------------------------------
@contextlib.contextmanager
def _record_outputs(modules: Sequence[nn.Module], start: int) -> Iterator[dict[int, torch.Tensor]]:
    """Record each module's (first) output at positions >= start  # [1, T - start, C]."""
    store: dict[int, torch.Tensor] = {}

    def make_hook(l: int):
        def hook(module, args, out):
            out = out[0] if isinstance(out, (tuple, list)) else out
            store[l] = out[:, start:].clone()
        return hook

    with hooks(post(m, make_hook(l)) for l, m in enumerate(modules)):
        yield store


@contextlib.contextmanager
def _override_forward(modules: dict[int, nn.Module], forwards: dict[int, Any]) -> Iterator[None]:
    """modules[l].forward <- forwards[l] (instance attribute, deleted on exit)."""
    done = []
    try:
        for l, fn in forwards.items():
            modules[l].forward = fn
            done.append(modules[l])
        yield
    finally:
        for m in done:
            del m.forward


def _sliced_linear(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A Linear computing only the given output rows of ``linear`` (same weights)."""
    out = nn.Linear(linear.in_features, rows.numel(), bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[rows])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[rows])
    return out.requires_grad_(False)


class _SlimAttention:
    """The receivers' query heads of one Llama-like attention module, each with its own copy of its KV head.

    ``z(args, kwargs, prefix)``, given the arguments the decoder layer passed to the attention: the
    receivers' z  # [B, T', n*D] (receiver i in channels i*D..(i+1)*D), exactly what the full module
    computes for those heads; ``prefix`` = the clean prefix KV of all KV heads, [1, K, p0, D] each, or None.
    """

    def __init__(self, attn: nn.Module, heads: Sequence[int], arch: Arch):
        D, group = arch.head_dim, arch.n_heads // arch.n_kv_heads
        rows = lambda hs: torch.cat([torch.arange(h * D, (h + 1) * D) for h in hs])  # noqa: E731
        self.kv = torch.tensor([h // group for h in heads])  # [n] KV head of each receiver
        slim = copy.copy(attn)  # shares parameters; own module table so the original is untouched
        slim._modules = dict(attn._modules)
        slim.q_proj = _sliced_linear(attn.q_proj, rows(heads))
        slim.k_proj = _sliced_linear(attn.k_proj, rows(self.kv.tolist()))
        slim.v_proj = _sliced_linear(attn.v_proj, rows(self.kv.tolist()))
        slim.o_proj = nn.Identity()
        slim.num_key_value_groups = 1
        self.module = slim
        params = inspect.signature(attn.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    @staticmethod
    def supports(attn: nn.Module, arch: Arch) -> bool:
        return arch.layout == "llama" and all(isinstance(getattr(attn, n, None), nn.Linear) for n in
                                              ("q_proj", "k_proj", "v_proj")) and hasattr(attn, "num_key_value_groups")

    def z(self, args: tuple, kwargs: dict, prefix: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The receivers' z  # [B, T', n*D], from the arguments the decoder layer passed to the attention."""
        kwargs = dict(kwargs)
        if "hidden_states" in kwargs:
            hidden = kwargs.pop("hidden_states")  # [B, T', C]
        else:
            hidden, args = args[0], args[1:]
        cache = None
        if prefix is not None:
            B = hidden.shape[0]
            k, v = (t[:, self.kv.to(t.device)].expand(B, -1, -1, -1) for t in prefix)  # [B, n, p0, D]
            cache = _PrefixKV(k, v)
        for name in ("cache", "past_key_values", "past_key_value"):
            kwargs.pop(name, None)
        kwargs[self.cache_kw] = cache
        return self.module.forward(hidden, *args, **kwargs)[0]  # [B, T', n*D]


class _PrefixKV:
    """A one-layer stand-in for a KV cache: prepends a fixed prefix to the new keys/values."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v  # [B, n, p0, D]

    def update(self, k: torch.Tensor, v: torch.Tensor, *args, **kwargs):
        return torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)  # [B, n, p0 + T', D]


class HFPathBackend:
    """Exact sender scores of a Hugging Face causal LM: suffix-only, layer-skipping, senders as batch rows."""

    name = "hf"

    def __init__(self, model: nn.Module, receivers: Any, config: HFFastConfig = HFFastConfig(), slim: bool = True):
        self.hf = HFBackend(model, config)
        self.model, self.arch = model, self.hf.arch
        self.n_layers, self.n_heads, self.n_kv_heads = self.arch.n_layers, self.arch.n_heads, self.arch.n_kv_heads
        self.receivers = normalize_receivers(receivers, self.n_layers, self.n_heads)
        self.table = receiver_table(self.receivers)
        self.last_layer = max(self.table)
        self.device = self.hf.device
        attns = self.arch.attentions
        self.slim: dict[int, _SlimAttention] = {}  # receiver layer -> its slim attention (empty: full attention)
        if slim and all(_SlimAttention.supports(attns[l], self.arch) for l in self.table):
            self.slim = {l: _SlimAttention(attns[l], heads, self.arch) for l, heads in self.table.items()}

    def answer_logits(self, ids: torch.Tensor, answer_pos: torch.Tensor) -> torch.Tensor:
        return self.hf.answer_logits(ids, answer_pos)  # [A, V]

    @torch.inference_mode()
    def patched_metrics(self, pair: PatchPair, metric: Metric, pbar=None,
                        heads: Sequence[Head] | None = None) -> torch.Tensor:
        """M_path of every sender  # [L, H] float64 (M_clean for the unreachable ones, not computed); with
        ``heads``, of those senders only."""
        arch, hf, p0, T = self.arch, self.hf, pair.first_diff, pair.seq_len
        # Clean run: prefix KV cache; layer outputs, attention outputs and z on the suffix.
        cache = None
        if p0 > 0:
            from transformers import DynamicCache
            cache = DynamicCache(config=self.model.config)
        with _record_layer_outputs(arch.layers, p0) as layer_out, _record_outputs(arch.attentions, p0) as attn_out, \
                record_inputs(arch.out_projs, p0) as z_clean:
            hidden = hf._base(pair.clean_ids[None], 0, cache)  # [1, T, C]
        m_clean = float(metric(hf._head(hidden, pair.answer_pos), pair)[0])
        prefix = prefix_kv(cache, self.n_layers, p0, T)
        del cache
        with record_inputs(arch.out_projs, p0) as z_corrupt:
            hf._base(pair.corrupt_ids[None], 0, None)

        run = dict(suffix_ids=pair.clean_ids[p0:][None], p0=p0, prefix=prefix, layer_out=layer_out,
                   attn_out=attn_out, z_clean=z_clean, z_corrupt=z_corrupt, rows=pair.answer_pos - p0)
        out = torch.full((self.n_layers, self.n_heads), m_clean, dtype=torch.float64)  # [L, H]
        asked = head_jobs(self.n_layers, self.n_heads, heads)
        jobs = [(l, h) for l, h in asked if l < self.last_layer]
        if pbar is not None:
            pbar.update(len(asked) - len(jobs))  # unreachable senders: exactly 0, no compute
        batches = micro_batches(jobs, lambda chunk: self._run_batch(chunk, **run), hf._auto_batch(T - p0, T),
                                device=self.device)
        for chunk, logits in batches:  # logits  # [B, A, V]
            for (l, h), v in zip(chunk, metric(logits, pair).tolist()):
                out[l, h] = v
            if pbar is not None:
                pbar.update(len(chunk))
        return out

    def _run_batch(self, jobs, suffix_ids, p0, prefix, layer_out, attn_out, z_clean, z_corrupt, rows):
        """Batch row i is sender jobs[i]; returns the receiver run's logits at the answer rows  # [B, A, V]."""
        arch, hf, B = self.arch, self.hf, len(jobs)
        sender_layer = torch.tensor([l for l, _ in jobs])  # [B]
        start = min(l for l, _ in jobs)
        by_layer: dict[int, list[tuple[int, int]]] = {}  # sender layer -> [(row, head)]
        for i, (l, h) in enumerate(jobs):
            by_layer.setdefault(l, []).append((i, h))

        def frozen_z(l: int) -> torch.Tensor:
            """Clean z of layer l for every row, with the sender's channels corrupted on its rows."""
            z = z_clean[l].expand(B, -1, -1).clone()  # [B, T', H*D]
            for i, h in by_layer.get(l, ()):
                sl = arch.head_slice(h)
                z[i, :, sl] = z_corrupt[l][0, :, sl]
            return z

        # ---- sender run: layers start..last_layer; every attention output is frozen to clean (+ the sender)
        z_recv: dict[tuple[int, int], torch.Tensor] = {}  # receiver -> z_r'  # [B, T', D]

        def frozen_output(l: int) -> torch.Tensor:
            out = attn_out[l].expand(B, -1, -1)  # [B, T', C]
            if l in by_layer:  # rows whose sender sits here: o_proj of the patched z
                idx = [i for i, _ in by_layer[l]]
                out = out.clone()
                out[idx] = arch.out_projs[l](frozen_z(l)[idx])
            return out

        def replay_attention(l: int):
            def forward(*args, **kwargs):
                return frozen_output(l), None
            return forward

        def slim_receivers(l: int):
            def forward(*args, **kwargs):
                z = self.slim[l].z(args, kwargs, prefix[l] if p0 > 0 else None)  # [B, T', n*D]
                D = arch.head_dim
                for j, h in enumerate(self.table[l]):
                    z_recv[(l, h)] = z[:, :, j * D:(j + 1) * D]
                if l == self.last_layer:
                    raise _StopForward
                return frozen_output(l), None
            return forward

        def full_receivers(l: int):  # pre-hook on out_projs[l]: the full attention ran on this run's input
            def hook(module, args):
                z = args[0]  # [B, T', H*D]
                for h in self.table[l]:
                    z_recv[(l, h)] = z[:, :, arch.head_slice(h)].clone()
                if l == self.last_layer:
                    raise _StopForward
                return (frozen_z(l),) + tuple(args[1:])
            return hook

        forwards = {l: replay_attention(l) for l in range(start, self.last_layer + 1) if l not in self.table}
        receiver_hooks = []
        if self.slim:  # the model's cache only sizes the masks; the slim modules read the prefix themselves
            forwards.update({l: slim_receivers(l) for l in self.table if l >= start})
            cache = hf._new_cache(prefix, self.n_layers, B) if p0 > 0 else None
        else:
            receiver_hooks = [pre(arch.out_projs[l], full_receivers(l)) for l in self.table if l >= start]
            cache = hf._new_cache(prefix, start, B) if p0 > 0 else None
        replay = contextlib.nullcontext() if start == 0 else _replay_layers(arch.layers[:start],
                                                                             layer_out[start - 1], B)
        try:
            with hooks(receiver_hooks), replay, _override_forward(dict(enumerate(arch.attentions)), forwards):
                hf._base(suffix_ids.expand(B, -1), p0, cache)
            raise RuntimeError("the sender run did not reach the last receiver layer's attention")
        except _StopForward:
            pass
        del cache

        # ---- receiver run: from the first receiver layer after the senders, receivers' z <- z_r'
        rstart = min(min(l for l in self.table if l > ls) for ls, _ in jobs)

        def patch_receivers(l: int):
            idx = (sender_layer < l).nonzero().flatten().tolist()  # rows whose sender can reach layer l

            def hook(module, args):
                z = args[0].clone()  # [B, T', H*D]
                for h in self.table[l]:
                    sl = arch.head_slice(h)
                    z[idx, :, sl] = z_recv[(l, h)][idx]
                return (z,) + tuple(args[1:])
            return hook

        def first_layer_attention(*args, **kwargs):  # its input is clean: z is clean but for the receivers
            return arch.out_projs[rstart](z_clean[rstart].expand(B, -1, -1)), None  # pre-hook patches receivers

        cache = hf._new_cache(prefix, rstart + 1, B) if p0 > 0 else None
        replay = contextlib.nullcontext() if rstart == 0 else _replay_layers(arch.layers[:rstart],
                                                                              layer_out[rstart - 1], B)
        with hooks(pre(arch.out_projs[l], patch_receivers(l)) for l in self.table if l >= rstart), replay, \
                _override_forward(dict(enumerate(arch.attentions)), {rstart: first_layer_attention}):
            hidden = hf._base(suffix_ids.expand(B, -1), p0, cache)  # [B, T', C]
        return hf._head(hidden, rows)  # [B, A, V]
