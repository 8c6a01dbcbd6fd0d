"""HybridModel / HybridForCausalLM: a Llama/Qwen3-shaped decoder whose attention layers are hybrids.

Everything but the attention mixer is the teacher's (embeddings, RMSNorms, gated MLPs, lm_head). The mixer
is ``HybridAttention`` (granularity "head" or "layer") or ``TokenHybridAttention`` ("token").

Generation: ``generate`` runs greedy decoding and sampling on the fused decode path (``hybrid.generation``: the
static cache, a CUDA graph on CUDA, padded batches with their ``attention_mask``); beam search,
``static_cache=False`` and what the fast path does not run take the eager path: the model keeps its own
``HybridCache`` under the keyword ``hybrid_cache`` (input and output), and overrides
``prepare_inputs_for_generation`` / ``_update_model_kwargs_for_generation`` so ``generate`` never builds a
``DynamicCache`` (works the same on transformers 5.17 and 5.24). Greedy, sampling and beam search are supported
there: before each step the cache's rows are aligned to the beams' sequences (``HybridCache.align``), which
reorders the FA keys/values, the GDN states and the conv states together. The eager path takes no padding:
``attention_mask`` must be all ones (a GDN state would absorb pad tokens), and a batch whose rows start or end
with different numbers of pad tokens is refused when no mask says otherwise.

Saving: ``save_pretrained(path, tokenizer=tok)`` also writes the tokenizer; ``from_pretrained`` checks the
folder first (``hybrid.folders.check_folder``: names a missing or truncated file and the fix).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from hybrid.cache import HybridCache
from hybrid.config import HybridConfig
from hybrid.folders import HybridFolderError, check_folder, weight_files
from hybrid.layers.token_attention import TokenHybridAttention
from hybrid.layers.common import MLP, RMSNorm, RotaryEmbedding, autocast_input, call_linear, is_new
from hybrid.layers.hybrid_attention import HybridAttention
from hybrid.layers.merge import FORMER_NAME

__all__ = ["HybridDecoderLayer", "HybridModel", "HybridForCausalLM", "HybridOutput", "register", "refuse_padded_rows"]


def refuse_file_path(path: Any) -> None:
    """``FileExistsError`` when ``path`` (a folder to save into) is an existing file."""
    if isinstance(path, (str, PathLike)) and Path(path).exists() and not Path(path).is_dir():
        raise FileExistsError(f"cannot save to {path}: it is an existing file, not a folder; remove it or give "
                              "a folder path")


@dataclass
class HybridOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # [B, T, V]
    last_hidden_state: torch.Tensor | None = None  # [B, T, C]
    hybrid_cache: HybridCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None  # (L+1) x [B, T, C]


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        token = config.options.granularity == "token"
        self.self_attn = TokenHybridAttention(config, layer_idx) if token else HybridAttention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache=None) -> torch.Tensor:
        # the normed input once in the autocast dtype (autocast_input), for all the Linears that read it
        x = x + self.self_attn(autocast_input(self.input_layernorm(x)), positions, cos, sin, cache)  # [B, T, C]
        return x + self.mlp(autocast_input(self.post_attention_layernorm(x)))  # [B, T, C]


def refuse_padded_rows(input_ids: torch.Tensor, pad_token_id: int | None, eos_token_id: Any = None) -> None:
    """Raise when the rows of ``input_ids`` [B, T] look padded: they start (left padding) or end (right padding)
    with runs of ``pad_token_id`` of different lengths. Rows that all start or end alike (e.g. one BOS that is
    also the pad token) pass. When the pad token is also an EOS token, a single trailing or leading one is
    ordinary text (a document's end in packed training data), so only runs of 2 or more count as padding."""
    if pad_token_id is None or input_ids.dim() != 2 or input_ids.shape[0] < 2:
        return
    eos = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    shortest = 2 if pad_token_id in eos else 1  # shortest run that counts as padding
    pad = (input_ids == pad_token_id).int()  # [B, T]
    for side, run in (("start", pad.cumprod(1).sum(1)), ("end", pad.flip(1).cumprod(1).sum(1))):  # [B] each
        if bool((run != run[0]).any()) and int(run.max()) >= shortest:
            raise ValueError(
                f"input_ids look padded: the rows {side} with different numbers of the pad token (id "
                f"{pad_token_id}) and no attention_mask says they are real tokens. A hybrid cannot skip padding (a "
                "GDN state would absorb the pad tokens): run the rows unpadded (one at a time, or cut to equal "
                "lengths), or pass attention_mask=torch.ones_like(input_ids) if these pad-id tokens are real text")


def _former_merge_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The merge's tensors of a folder whose weights use the merge's older name (``...self_attn.fusion.gamma``),
    under the current names (``...self_attn.merge.gamma``); empty for any other folder."""
    old, new = f".self_attn.{FORMER_NAME}.", ".self_attn.merge."
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_files(folder).items():
        if old in name:
            by_file.setdefault(file, []).append(name)
    if not by_file:
        return {}
    from safetensors import safe_open

    out = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                out[name.replace(old, new)] = f.get_tensor(name)
    return out


@torch.no_grad()
def _load_former_merge(model: nn.Module, tensors: dict[str, torch.Tensor], where: Any) -> None:
    """Copy ``tensors`` (``_former_merge_tensors``) into ``model``'s parameters (a HybridModel reads the
    HybridForCausalLM names without their ``model.`` prefix)."""
    params = dict(model.named_parameters())
    prefix = f"{model.base_model_prefix}."
    for name, value in tensors.items():
        key = name if name in params else name[len(prefix):] if name.startswith(prefix) else name
        if key not in params:
            raise HybridFolderError(f"{where}: its weights hold {name} (the merge's older name {FORMER_NAME!r}), "
                                    f"which this {type(model).__name__} has no parameter for; save the model again")
        params[key].copy_(value)


class HybridPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    base_model_prefix = "model"
    _no_split_modules = ["HybridDecoderLayer"]
    supports_gradient_checkpointing = False
    _supports_sdpa = True
    _is_stateful = True  # no assisted generation (a GDN state cannot be rolled back)

    def _init_weights(self, module: nn.Module) -> None:
        """Standard init for Linear/Embedding/RMSNorm (super), then the new parameters' one initialisation,
        ``reset_new_parameters`` (the same values ``from_mask`` gives them). Skipped for weights loaded from
        disk (transformers flags them ``_is_hf_initialized``)."""
        super()._init_weights(module)
        reset = getattr(module, "reset_new_parameters", None)
        if reset is not None and not any(getattr(p, "_is_hf_initialized", False) for p in module.parameters()):
            reset()  # children are visited first: a branch's reset overrides super()'s init of its new Linears

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:  # generate must not build a DynamicCache for us
        return False

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any):
        """``PreTrainedModel.from_pretrained`` after ``check_folder``; a folder whose weights name the merge by its
        older name (``...self_attn.fusion.gamma``) loads them into the merge (``_former_merge_tensors``)."""
        register()
        former = {}
        if isinstance(pretrained_model_name_or_path, (str, PathLike)) and Path(pretrained_model_name_or_path).is_dir():
            check_folder(pretrained_model_name_or_path)
            former = _former_merge_tensors(Path(pretrained_model_name_or_path))
        if not former:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report would list the renamed tensors as missing / unexpected
        try:
            loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        finally:
            hf_logging.set_verbosity(verbosity)
        _load_former_merge(loaded[0] if isinstance(loaded, tuple) else loaded, former, pretrained_model_name_or_path)
        return loaded

    def save_pretrained(self, save_directory: Any, *args: Any, tokenizer: Any = None, **kwargs: Any) -> None:
        """``PreTrainedModel.save_pretrained``; with ``tokenizer`` the tokenizer is saved in the same folder, so
        ``hybrid.load(path, with_tokenizer=True)`` and ``headscope.load_model(path)`` find it. A path that is an
        existing file is refused (``FileExistsError``; transformers would only log it and save nothing)."""
        refuse_file_path(save_directory)
        super().save_pretrained(save_directory, *args, **kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(save_directory)

    def new_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters that were not copied from the teacher (FA gate, beta/decay, convs, merge), as marked where
        the layers create them (``hybrid.layers.common.mark_new``), by qualified name."""
        out = {}
        for mname, module in self.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if is_new(module, pname, p):
                    out[f"{mname}.{pname}" if mname else pname] = p
        return out

    def reused_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters initialised from the teacher's (possibly row-selected or repeated)."""
        new = self.new_parameters()
        return {n: p for n, p in self.named_parameters() if n not in new}


class HybridModel(HybridPreTrainedModel):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None))
        self.layers = nn.ModuleList(HybridDecoderLayer(config, l) for l in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None,
                hybrid_cache: HybridCache | None = None, use_cache: bool | None = None,
                output_hidden_states: bool | None = None, **kwargs: Any) -> HybridOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            raise ValueError("HybridModel does not support padding (attention_mask has zeros): the GDN state "
                             "would absorb pad tokens; run equal-length sequences or one sequence at a time")
        past = hybrid_cache.seen_tokens if hybrid_cache is not None else 0
        if attention_mask is None and input_ids is not None and past == 0:
            refuse_padded_rows(input_ids, getattr(self.config, "pad_token_id", None),
                               getattr(self.config, "eos_token_id", None))
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, C]
        B, T, _ = x.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and hybrid_cache is None:
            hybrid_cache = HybridCache.empty(self.config.num_hidden_layers)
        per_row = getattr(hybrid_cache, "per_row", False)  # hybrid.decoding.StaticHybridCache: ragged rows
        if per_row:
            positions, cos, sin = hybrid_cache.begin_step(T, x.dtype)  # [B, T], [B, T, D] x2 (no host sync)
        elif position_ids is not None:
            positions = position_ids.reshape(-1, position_ids.shape[-1])[0].to(x.device)  # [T]
            if positions.numel() != T or (hybrid_cache is not None and int(positions[0]) != past):
                raise ValueError(f"position_ids must be {past}..{past + T - 1} (contiguous, after the cache); "
                                 f"got {positions.tolist()[:4]}...")
        else:
            positions = torch.arange(past, past + T, device=x.device)  # [T]
        if not per_row:
            cos, sin = self.rotary_emb(positions, x.dtype)  # [T, D] each
        hidden = [x] if output_hidden_states else None
        for l, layer in enumerate(self.layers):
            x = layer(x, positions, cos, sin, hybrid_cache.layers[l] if hybrid_cache is not None else None)
            if hidden is not None:
                hidden.append(x)
        x = self.norm(x)
        if per_row:
            hybrid_cache.end_step(T)
        elif hybrid_cache is not None:
            hybrid_cache.seen_tokens = past + T
            hybrid_cache.record(input_ids, inputs_embeds)  # what each row consumed (beam search aligns on it)
        if hidden is not None:
            hidden[-1] = x
        return HybridOutput(last_hidden_state=x, hybrid_cache=hybrid_cache if use_cache else None,
                            hidden_states=tuple(hidden) if hidden is not None else None)


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig) -> None:
        super().__init__(config)
        self.model = HybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None,
                hybrid_cache: HybridCache | None = None, use_cache: bool | None = None,
                labels: torch.LongTensor | None = None, logits_to_keep: int = 0,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> HybridOutput:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, hybrid_cache=hybrid_cache, use_cache=use_cache,
                         output_hidden_states=output_hidden_states)
        h = out.last_hidden_state  # [B, T, C]
        logits = call_linear(self.lm_head, h[:, -logits_to_keep:] if logits_to_keep else h)  # [B, T, V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return HybridOutput(loss=loss, logits=logits, last_hidden_state=h, hybrid_cache=out.hybrid_cache,
                            hidden_states=out.hidden_states)

    # ---- generation: the fused decode path (hybrid.generation), else our own cache through generate() ----
    def generate(self, *args: Any, static_cache: bool | None = None, **kwargs: Any):
        """transformers' ``generate``; greedy decoding and sampling run on the fused decode path (the static
        cache, a CUDA graph on CUDA; the default on CUDA and the CPU): ``hybrid.generation``. ``static_cache=False``
        (or ``generation_config.static_cache = False``) keeps transformers' loop on the dynamic ``HybridCache``."""
        from hybrid.generation import generate

        return generate(self, *args, static_cache=static_cache, **kwargs)

    def greedy_decode(self, prompts: Sequence[torch.Tensor], max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation of ragged prompts (1-d token ids, any lengths), batched: each prompt prefilled into
        its own row of the static cache, then one decode step for all rows (``hybrid.decoding.greedy_decode``).
        Returns the new tokens [B, max_new_tokens]. ``headscope.evaluate`` uses it for this model's greedy
        continuations, which it could otherwise batch only by equal length (a padded row would reach a GDN state)."""
        from hybrid.decoding import greedy_decode

        return greedy_decode(self, prompts, max_new_tokens)

    def _sample(self, input_ids: torch.LongTensor, logits_processor: Any, stopping_criteria: Any,
                generation_config: Any, synced_gpus: bool = False, streamer: Any = None, **model_kwargs: Any):
        from hybrid.generation import sample

        return sample(self, input_ids, logits_processor, stopping_criteria, generation_config,
                      synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

    def _beam_search(self, *args: Any, **kwargs: Any):
        from hybrid.generation import beam_search

        return beam_search(self, *args, **kwargs)

    # ---- eager generation: thread our own cache through generate() ---------------------------
    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, hybrid_cache: HybridCache | None = None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool | None = True,
                                      inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> dict[str, Any]:
        past = hybrid_cache.seen_tokens if hybrid_cache is not None else 0
        inputs: dict[str, Any] = {"hybrid_cache": hybrid_cache, "use_cache": use_cache,
                                  "attention_mask": attention_mask}
        if past == 0 and (attention_mask is None or bool(attention_mask.all())):
            # generate() makes an all-ones mask itself when the pad token is also EOS: check the prompt rows
            gen, cfg = self.generation_config, self.config
            pad, eos = getattr(cfg, "pad_token_id", None), getattr(cfg, "eos_token_id", None)
            refuse_padded_rows(input_ids, gen.pad_token_id if pad is None else pad,
                               gen.eos_token_id if eos is None else eos)
        if inputs_embeds is not None and past == 0:
            inputs["inputs_embeds"] = inputs_embeds
        elif past == 0:
            inputs["input_ids"] = input_ids
        else:
            hybrid_cache.align(input_ids)  # beam search: row r of the cache becomes the state of beam r's prefix
            inputs["input_ids"] = input_ids[:, hybrid_cache.n_ids:].contiguous()  # positions not in the cache
        return inputs

    def _update_model_kwargs_for_generation(self, outputs: ModelOutput, model_kwargs: dict[str, Any],
                                            is_encoder_decoder: bool = False, num_new_tokens: int = 1,
                                            **kwargs: Any) -> dict[str, Any]:
        model_kwargs["hybrid_cache"] = outputs.get("hybrid_cache")
        mask = model_kwargs.get("attention_mask")
        if mask is not None:
            model_kwargs["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], num_new_tokens)], -1)
        model_kwargs.pop("position_ids", None)
        return model_kwargs

    def _reorder_cache(self, cache: HybridCache, beam_idx: torch.LongTensor) -> HybridCache:
        """Kept for generate versions that reorder under ``hybrid_cache``; ``align`` then finds nothing to do."""
        cache.reorder_cache(beam_idx)
        return cache


_REGISTERED = False


def register() -> None:
    """Register HybridConfig / HybridForCausalLM with AutoConfig / AutoModel(ForCausalLM) (idempotent).

    ``import hybrid`` calls it (the ecosystem's convention for custom architectures, as flash-linear-attention
    does), so ``AutoModelForCausalLM.from_pretrained(path)`` loads a saved hybrid after a plain ``import hybrid``."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    try:
        AutoConfig.register(HybridConfig.model_type, HybridConfig)
    except ValueError:  # already registered (e.g. by another copy of this module)
        pass
    for auto, cls in ((AutoModel, HybridModel), (AutoModelForCausalLM, HybridForCausalLM)):
        try:
            auto.register(HybridConfig, cls)
        except ValueError:
            pass
    _REGISTERED = True
