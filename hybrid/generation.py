"""``HybridForCausalLM.generate()`` on the fused decode path: the preallocated cache and decode step of
``hybrid.decoding`` (a CUDA graph on CUDA) under transformers' own generation API.

    out = model.generate(ids, attention_mask=mask, max_new_tokens=64)                        # the fast path
    out = model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=True, top_p=0.9)
    out = model.generate(ids, max_new_tokens=64, static_cache=False)                          # transformers' loop
    model.generation_config.static_cache = False                                              # the same, kept
    out = model.generate(ids, max_new_tokens=64, compile_decode=True)   # torch.compile the decode step

transformers prepares everything as for any model (the generation config merged with the keywords, the logits
processors and warpers, the stopping criteria: max_length / max_new_tokens, EOS ids, stop strings with
``tokenizer=``, max_time; the streamer's prompt), then calls the model's ``_sample`` for greedy decoding and
sampling: ``sample`` below runs it on the fast path. Each row's prompt without its padding is prefilled into
its own row of a ``StaticHybridCache`` (no pad token reaches a GDN state, so the model gives each row of a padded
batch the logits it gives the row alone), then ``Decoder`` steps all rows together. Per step the loop is transformers': the
logits cast to float32, the processors on the ids so far [B, T + i], argmax or ``torch.multinomial`` over the
softmax (the same random draws as transformers' loop), finished rows continue with the pad token, the stopping
criteria, ``streamer.put``. So greedy tokens are the eager path's, and sampled ones too wherever the two paths'
float32 logits are equal.

Padding: left-padded rows (the layout transformers expects) are taken as given; right-padded rows are moved to
the left for the run and the output keeps the input as given: ``sequences = cat(input_ids, new tokens)``
[B, T + n], rows that finished early filled with the pad token. The processors and stopping criteria see the
batch left-padded, exactly as transformers shows it to them for any model: the repetition penalty skips the
padding (transformers passes it the mask's padding lengths); processors that read the ids themselves
(``no_repeat_ngram_size``, ``sequence_bias``) see the pad ids, as they do in transformers.

The cache and the captured decode graph are kept for the next call with the same batch size, capacity (prompt +
new tokens, rounded up to ``CAPACITY_STEP``), dtype and device, unless a weight, a hook or a decode op
(``use_fused_decode``) changed in between:
``release(model)`` frees them. A model with forward hooks (headscope's interventions) steps without the graph, so
its hooks run at every step.

On the eager path instead (transformers' loop with the dynamic ``HybridCache``), each time with one
``logger.info`` line naming why: beam search and beam sampling, ``inputs_embeds``, a cache passed in,
``use_cache=False``, ``output_attentions`` / ``output_hidden_states``, classifier-free guidance, chunked prefill,
``synced_gpus``, assistant roles, input ids on another device than the model, padding that is not a run of
zeros at one end of each row (or a row of padding only), and padding that no ``attention_mask`` argument declares
(transformers infers a mask from pad ids when pad != EOS; the hybrid does not guess, and the eager path refuses
such rows as before). ``output_scores`` / ``output_logits`` are returned by the fast path. Opting out
(``static_cache=False``) is not logged.

``compile_decode=True`` (or ``generation_config.compile_decode = True``) compiles the decode step with
``torch.compile`` before the CUDA graph captures it (``Decoder(compile=True)``; the first call compiles, later
calls with the same kept cache reuse it). Off by default: compiling costs tens of seconds on the first call of a
shape (the whole-model benchmark's 28 layers), which a short generation does not win back. The compiled step with
the fused GDN op (``hybrid.layers.hybrid_attention.use_fused_decode(model)`` before the call) is the fastest
measured decode step (docs/kernels.md); ``generate()`` through it is not timed yet. ``pdl_decode=True`` (or
``generation_config.pdl_decode``) steps with programmatic dependent launch (``Decoder(pdl=True)``; compute capability
9.0+): the same tokens; off by default until timed.
"""
from __future__ import annotations

import contextvars
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationMixin
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hybrid.decoding import Decoder, StaticHybridCache, prefill

__all__ = ["generate", "sample", "beam_search", "release", "STATIC_CACHE_ON_CPU", "CAPACITY_STEP", "CHECK_EVERY"]

logger = logging.getLogger(__name__)

STATIC_CACHE_ON_CPU = True  # the fast path is also the default on the CPU (research/perf/generate_speed.py)
CAPACITY_STEP = 128  # cache capacity rounded up to a multiple of this, so calls of nearby lengths share one graph
CHECK_EVERY = 8  # on CUDA without a streamer: read "has every row finished?" on the host every 8 steps

@dataclass(frozen=True)
class _Call:
    static_cache: bool | None  # generate(static_cache=...)
    mask_given: bool  # an attention_mask was passed (padding is only stripped where a mask says so)
    compile_decode: bool | None = None  # generate(compile_decode=...)
    pdl_decode: bool | None = None  # generate(pdl_decode=...)


_CALL: contextvars.ContextVar = contextvars.ContextVar("hybrid_generate_call", default=_Call(None, True))


# ---- generate(): the static_cache switch and right padding -----------------------------------------------
def generate(model, *args: Any, static_cache: bool | None = None, compile_decode: bool | None = None,
             pdl_decode: bool | None = None, **kwargs: Any):
    """``model.generate(...)`` of a HybridForCausalLM: transformers' ``generate`` with greedy decoding and
    sampling on the fused decode path (see the module docstring). ``static_cache``: True / False to take or
    leave the fast path; None (default): ``generation_config.static_cache`` when set, else on: on CUDA with a
    CUDA graph, and on the CPU too (``STATIC_CACHE_ON_CPU``: research/perf/generate_speed.py on the CPU with the
    reference model measures tokens/s within about 10% of transformers' loop either way, 3% faster at the median of
    prompts of 16 to 1024 tokens and batches of 1 to 8; the same tokens, and only it takes padded batches).
    ``compile_decode``: True to ``torch.compile`` the fast path's decode step; None (default):
    ``generation_config.compile_decode`` when set, else off. ``pdl_decode``: True for programmatic dependent launch
    in the fast path's decode step (``Decoder(pdl=True)``: compute capability 9.0+, else nothing changes); None
    (default): ``generation_config.pdl_decode`` when set, else off."""
    if static_cache not in (None, True, False):
        raise ValueError(f"static_cache must be True, False or None (the default), got {static_cache!r}")
    for name, value in (("compile_decode", compile_decode), ("pdl_decode", pdl_decode)):
        if value not in (None, True, False):
            raise ValueError(f"{name} must be True, False or None (the default), got {value!r}")
    args, kwargs, original = _left_pad_the_input(args, kwargs, static_cache)
    token = _CALL.set(_Call(static_cache, kwargs.get("attention_mask") is not None, compile_decode, pdl_decode))
    try:
        out = GenerationMixin.generate(model, *args, **kwargs)
    finally:
        _CALL.reset(token)
    if original is not None:  # right-padded input: the prompt part as given
        seqs = out if isinstance(out, torch.Tensor) else out.sequences  # [B * k, T + n]
        B, T = original.shape
        seqs[:, :T] = original.repeat_interleave(seqs.shape[0] // B, 0).to(seqs.device)
    return out


def _input_slot(args: tuple, kwargs: dict) -> tuple[str | int | None, Any]:
    """Where generate's input ids are (positional 0, 'inputs' or 'input_ids') and the value."""
    if args:
        return 0, args[0]
    for key in ("inputs", "input_ids"):
        if kwargs.get(key) is not None:
            return key, kwargs[key]
    return None, None


def _right_padding(mask: torch.Tensor) -> torch.Tensor | None:
    """Per row the number of trailing zeros [B] when every row of ``mask`` [B, T] is ones then zeros and some
    row ends with a zero; else None."""
    m = mask.ne(0)  # [B, T]
    if bool(m[:, -1].all()):
        return None
    lead = m.int().cumprod(1).sum(1)  # [B] leading ones
    if not bool((lead == m.sum(1)).all()):
        return None
    return m.shape[1] - lead  # [B]


def _roll_rows(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Row b of x [B, T] rotated right by shift[b] (trailing padding moves to the front) -> [B, T]."""
    T = x.shape[1]
    idx = (torch.arange(T, device=x.device) - shift.to(x.device)[:, None]) % T  # [B, T]
    return x.gather(1, idx)


def _left_pad_the_input(args: tuple, kwargs: dict, static_cache: bool | None):
    """Right-padded input ids with their attention_mask, moved to left padding (when the fast path may run):
    returns (args, kwargs, the original ids or None)."""
    mask = kwargs.get("attention_mask")
    slot, ids = _input_slot(args, kwargs)
    if (static_cache is False or not isinstance(mask, torch.Tensor) or not isinstance(ids, torch.Tensor)
            or ids.dim() != 2 or ids.shape != mask.shape or ids.dtype.is_floating_point or ids.shape[1] == 0):
        return args, kwargs, None
    shift = _right_padding(mask)
    if shift is None:
        return args, kwargs, None
    kwargs = dict(kwargs, attention_mask=_roll_rows(mask, shift))
    moved = _roll_rows(ids, shift)  # [B, T]
    if slot == 0:
        args = (moved, *args[1:])
    else:
        kwargs[slot] = moved
    if kwargs.get("streamer") is not None:
        kwargs["streamer"] = _PromptAsGiven(kwargs["streamer"], ids)
    return args, kwargs, ids


class _PromptAsGiven:
    """A streamer whose first ``put`` (the prompt) receives the input ids as the caller gave them."""

    def __init__(self, streamer, prompt: torch.Tensor) -> None:
        self.streamer, self.prompt, self.first = streamer, prompt, True

    def put(self, value: torch.Tensor) -> None:
        if self.first:
            self.first = False
            value = self.prompt.cpu()
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()


# ---- the decoding loop ------------------------------------------------------------------------------------
def _asked(name: str, model, generation_config) -> bool | None:
    """generate(name=...) (``static_cache``, ``compile_decode``, ``pdl_decode``), else the call's generation config's
    ``name``, else the model's (transformers versions differ in carrying custom entries into the merged config),
    else None."""
    req = getattr(_CALL.get(), name)
    for cfg in (generation_config, getattr(model, "generation_config", None)):
        if req is None:
            req = getattr(cfg, name, None)
    return req


def _requested(model, generation_config) -> bool:
    """Whether this call takes the fast path: ``static_cache`` as asked (``_asked``), else the default."""
    req = _asked("static_cache", model, generation_config)
    if req is None:
        return model.device.type == "cuda" or STATIC_CACHE_ON_CPU
    return bool(req)


def _left_padding_problem(mask: torch.Tensor) -> str | None:
    """None when every row of ``mask`` [B, T] is zeros then at least one one (left padding or none)."""
    m = mask.ne(0)  # [B, T]
    n = m.sum(1)  # [B]
    if bool((n == 0).any()):
        return "a row of the attention_mask has no token (padding only)"
    trail = m.flip(1).int().cumprod(1).sum(1)  # [B] trailing ones
    if not bool((trail == n).all()):
        return "the attention_mask is not a run of zeros at one end of each row"
    return None


def _eager_reason(model, input_ids: torch.Tensor, logits_processor, generation_config, synced_gpus: bool,
                  model_kwargs: dict) -> str | None:
    """None: the fast path runs. Otherwise why transformers' loop runs ('' when asked for: not logged)."""
    device = model.device
    if not _requested(model, generation_config):
        return ""
    checks = (
        (synced_gpus, "synced_gpus (generation in step across processes)"),
        (getattr(generation_config, "is_assistant", False), "the model is an assistant model"),
        (model_kwargs.get("inputs_embeds") is not None, "inputs_embeds (the fast path prefills token ids)"),
        (model_kwargs.get("hybrid_cache") is not None or model_kwargs.get("cache") is not None
         or model_kwargs.get("past_key_values") is not None, "a cache was passed in"),
        (model_kwargs.get("use_cache") is False, "use_cache=False"),
        (bool(getattr(generation_config, "output_attentions", False))
         or bool(getattr(generation_config, "output_hidden_states", False)),
         "output_attentions / output_hidden_states (the fused decode step returns neither)"),
        (getattr(generation_config, "prefill_chunk_size", None) is not None, "prefill_chunk_size"),
        (any(type(p).__name__.endswith("ClassifierFreeGuidanceLogitsProcessor") for p in logits_processor),
         "classifier-free guidance (its processor runs the model itself)"),
        (input_ids.device != device, f"input_ids on {input_ids.device}, the model on {device}"),
        (input_ids.dim() != 2 or input_ids.shape[1] == 0, "no prompt token"),
    )
    for hit, why in checks:
        if hit:
            return why
    if generation_config.max_length is None or generation_config.max_length <= input_ids.shape[1]:
        return "max_length leaves no new token"
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        if not _CALL.get().mask_given:  # generate() inferred it from pad ids: not stripped (the eager path refuses)
            return "padding inferred from pad token ids without an attention_mask (pass the tokenizer's mask)"
        return _left_padding_problem(mask)
    return None


def sample(model, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
           synced_gpus: bool = False, streamer=None, **model_kwargs: Any):
    """``HybridForCausalLM._sample`` (greedy decoding and sampling): the fast path when it applies, else
    transformers' ``GenerationMixin._sample``."""
    mask = model_kwargs.get("attention_mask")  # [B, T] or None
    if mask is not None and not _CALL.get().mask_given and bool(mask.ne(0).all()):
        # generate()'s own all-ones mask ("no padding"): transformers >= 5.2x drops it before _sample, earlier 5.x
        # versions pass it on; dropped here too, so both paths see a call without a mask as the same call
        model_kwargs["attention_mask"] = None
    why = _eager_reason(model, input_ids, logits_processor, generation_config, synced_gpus, model_kwargs)
    if why is None:
        return _fast_sample(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                            model_kwargs)
    if why:
        logger.info("hybrid generate(): transformers' decoding loop (not the static cache) because of %s", why)
    return GenerationMixin._sample(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                   synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)


def beam_search(model, *args: Any, **kwargs: Any):
    """``HybridForCausalLM._beam_search``: transformers' beam search on the dynamic cache (the static cache does
    not reorder rows), said once per call."""
    if _requested(model, kwargs.get("generation_config")):
        logger.info("hybrid generate(): transformers' decoding loop (not the static cache) because of beam "
                    "search (its rows are reordered every step)")
    return GenerationMixin._beam_search(model, *args, **kwargs)


def _check_every(device: torch.device, streamer) -> int:
    """Steps between host reads of "has every row finished?": CHECK_EVERY on CUDA without a streamer (the host
    queues steps ahead of the GPU), else every step."""
    return CHECK_EVERY if device.type == "cuda" and streamer is None else 1


@torch.no_grad()
def _fast_sample(model, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
                 streamer, model_kwargs: dict):
    B, T = input_ids.shape
    mask = model_kwargs.get("attention_mask")  # [B, T] left-padded, or None (no padding)
    if mask is None:  # the eager path's check: rows that look padded without a mask saying so are refused
        model.prepare_inputs_for_generation(input_ids, hybrid_cache=None, attention_mask=None)
        prompts = list(input_ids)  # B x [T]
    else:
        n = mask.ne(0).sum(1).tolist()
        prompts = [input_ids[b, T - n[b]:] for b in range(B)]  # B x [n_b]
    n_max = generation_config.max_length - T
    pad = generation_config._pad_token_tensor
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    do_sample = generation_config.do_sample
    want = generation_config.return_dict_in_generate
    scores = () if want and generation_config.output_scores else None
    raw = () if want and generation_config.output_logits else None
    check = _check_every(input_ids.device, streamer)
    kept = _take(model, B, max(p.numel() for p in prompts) + n_max, input_ids.device.type == "cuda",
                 bool(_asked("compile_decode", model, generation_config)),
                 bool(_asked("pdl_decode", model, generation_config)))
    try:
        cache, logits = prefill(model, prompts, n_max, group=B, cache=kept.cache)  # logits [B, V]
        ids = input_ids.new_empty(B, T + n_max)  # [B, T + N] the prompt, then the new tokens
        ids[:, :T] = input_ids
        unfinished = torch.ones(B, dtype=torch.long, device=input_ids.device)  # [B]
        alive = torch.ones(n_max, dtype=torch.bool, device=input_ids.device)  # [N] a row unfinished after step i
        if pad is not None:
            pad = pad.to(input_ids.device)
        n = 0
        for i in range(n_max):
            if i:
                logits = kept.decoder.step(ids[:, T + i - 1:T + i])  # [B, 1] -> [B, V]
            next_logits = logits.to(copy=True, dtype=torch.float32)  # [B, V]
            next_scores = logits_processor(ids[:, :T + i], next_logits)  # [B, V]
            if scores is not None:
                scores += (next_scores,)
            if raw is not None:
                raw += (next_logits,)
            if do_sample:
                probs = torch.nn.functional.softmax(next_scores, dim=-1)  # [B, V]
                nxt = torch.multinomial(probs, num_samples=1).squeeze(1)  # [B]
            else:
                nxt = torch.argmax(next_scores, dim=-1)  # [B]
            if has_eos:
                nxt = nxt * unfinished + pad * (1 - unfinished)  # [B] finished rows: the pad token
            ids[:, T + i] = nxt
            n = i + 1
            unfinished = unfinished & ~stopping_criteria(ids[:, :T + n], scores)
            if streamer is not None:
                streamer.put(nxt.cpu())
            if check == 1:
                if unfinished.max() == 0:
                    break
                continue
            alive[i] = unfinished.any()
            if n % check == 0 and not bool(alive[i]):
                break
        if check > 1:  # steps past the one where every row finished are dropped, as if checked every step
            done = (~alive[:n]).nonzero()  # [k, 1]
            if done.numel():
                n = int(done[0, 0]) + 1
                scores = scores[:n] if scores is not None else None
                raw = raw[:n] if raw is not None else None
    finally:
        kept.busy = False
    if streamer is not None:
        streamer.end()
    sequences = torch.cat([input_ids, ids[:, T:T + n]], 1)  # [B, T + n]
    if want:
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=raw)
    return sequences


# ---- the cache and decode graph kept between calls ---------------------------------------------------------
@dataclass
class _Kept:
    key: tuple
    cache: StaticHybridCache
    decoder: Decoder
    busy: bool = False


_KEPT: "weakref.WeakKeyDictionary[torch.nn.Module, _Kept]" = weakref.WeakKeyDictionary()


def _model_key(model) -> tuple:
    """What a captured decode step depends on besides shapes: every parameter's storage and in-place version
    (an optimizer step changes it), the hooks on the modules, and each module's ``decode_backend`` (the GDN
    branches' split or fused decode op, ``use_fused_decode``)."""
    params = tuple((p.data_ptr(), p._version) for p in model.parameters())
    hooks = tuple(id(h) for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)
                  for h in d.values())
    backends = tuple(m.decode_backend for m in model.modules() if hasattr(m, "decode_backend"))
    return params, hooks, backends


def _take(model, batch: int, need: int, cuda: bool, compile: bool = False, pdl: bool = False) -> _Kept:
    """The kept cache and Decoder when they fit this call, else new ones (kept in place of the old). On CUDA the
    step is a CUDA graph, unless the model carries forward hooks (they must run at every step); ``compile``:
    the step is ``torch.compile``d (not with hooks either); ``pdl``: programmatic dependent launch."""
    p = next(model.parameters())
    capacity = -(-need // CAPACITY_STEP) * CAPACITY_STEP
    model_key = _model_key(model)
    cuda_graph = cuda and not model_key[1]
    compile = compile and not model_key[1]
    key = (batch, capacity, p.dtype, p.device, cuda_graph, compile, pdl, model_key)
    kept = _KEPT.get(model)
    if kept is not None and not kept.busy and kept.key == key:
        kept.busy = True
        return kept
    if kept is not None and not kept.busy:
        del _KEPT[model], kept  # free the old buffers and graph before allocating
        if cuda_graph:
            torch.cuda.empty_cache()
    elif kept is not None:  # in use by another call: this one gets its own
        cache = StaticHybridCache.allocate(model, batch, capacity)
        return _Kept(key, cache, Decoder(model, cache, cuda_graph=cuda_graph, compile=compile, pdl=pdl), busy=True)
    cache = StaticHybridCache.allocate(model, batch, capacity)
    dec = Decoder(model, cache, cuda_graph=cuda_graph, compile=compile, pdl=pdl)
    new = _KEPT[model] = _Kept(key, cache, dec, busy=True)
    return new


def release(model) -> None:
    """Free the cache and decode graph that ``generate()`` keeps for ``model``'s next call."""
    if _KEPT.pop(model, None) is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
