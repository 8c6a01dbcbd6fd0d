"""What an evaluation needs to know about the model: its training length, where its positions end, whether
it takes padding, which keyword its cache goes under, and that the tokenizer fits it.

``EvalContext`` carries the run-wide settings (seed, batch size, progress, token budget, time budget) into each
evaluation, and prints its progress lines (``ctx.log``).
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.nn as nn

__all__ = ["EvalContext", "TokenizerMismatchError", "LengthStop", "BudgetExceeded", "training_length",
           "position_limit", "takes_padding", "cache_keyword", "check_tokenizer", "model_info", "context_lengths",
           "is_oom", "fewer_rows_after_oom"]

T = TypeVar("T")
ANSWER_ROOM = 8  # a prompt of a length "multiple" leaves this many positions for the answer (2048 -> 2040)


class TokenizerMismatchError(ValueError):
    """The tokenizer does not belong to the model."""


class LengthStop(RuntimeError):
    """A context length the model cannot take (out of memory, or past its positions); longer ones are skipped."""


class BudgetExceeded(RuntimeError):
    """The evaluation's time budget ran out (``EvalContext.deadline``); its remaining rows are "skipped"."""


@dataclass(frozen=True)
class EvalContext:
    seed: int = 0
    batch_size: int = 8  # prompts per forward at most
    token_budget: int = 65536  # prompt tokens per forward at most (batch = min(batch_size, budget // length))
    progress: bool = True  # progress bars, and a start and a done line (with seconds) per evaluation and length
    workers: int = 0  # spawned processes that build prompts (0: in this process)
    budget_s: float | None = None  # seconds each evaluation may take; what is left after it is "skipped"
    deadline: float | None = None  # time.monotonic() at which the running evaluation's budget ends (set by evaluate)
    # files for the result folder, {file name: [JSON records]} (one shared dict, set by evaluate; None: not kept);
    # save_results writes each as JSONL beside results.json (e.g. the fidelity evaluation's chat answers)
    artifacts: dict | None = field(default=None, compare=False, repr=False)
    # the teacher's side of the fidelity evaluations kept on disk (headscope.evaluate.teacher_cache.TeacherCache;
    # None: computed every time)
    teacher_cache: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("budget_s", "deadline"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"{name}={v!r}: give seconds >= 0, or None for no limit")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise ValueError(f"workers={self.workers!r}: give an int >= 0")
        for name in ("batch_size", "token_budget"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: give an int >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: give an int")

    def rows_per_batch(self, length: int) -> int:
        return max(1, min(self.batch_size, self.token_budget // max(1, length)))

    def seconds_left(self) -> float | None:
        """Seconds until the deadline (0 once passed), or None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def over_budget(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def check_budget(self, where: str) -> None:
        """Raise ``BudgetExceeded`` once the deadline has passed (called between batches)."""
        if self.over_budget():
            raise BudgetExceeded(f"budget: the evaluation's time budget ran out during {where}")

    def budget_note(self, what: str) -> str:
        """The note of a row skipped for the budget (it starts with "budget:")."""
        limit = f"budget_s={self.budget_s:g}" if self.budget_s is not None else "the run's time limit"
        return f"budget: {what} not run, the evaluation's time budget ({limit}) was spent"

    def log(self, message: str) -> None:
        """One progress line on stderr, flushed (with ``progress``): where a long run is, and how long each step
        took, whatever the output buffering."""
        if self.progress:
            print(f"[eval {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _folder(model: nn.Module) -> Path | None:
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    p = Path(name)
    return p if name and p.is_dir() else None


def training_length(model: nn.Module) -> int:
    """The sequence length the model was trained at: train_summary.json's mixture.seq_len beside the weights
    (the reference model's trainer writes it), else the config's max_position_embeddings / n_positions."""
    folder = _folder(model)
    if folder is not None and (folder / "train_summary.json").exists():
        try:
            summary = json.loads((folder / "train_summary.json").read_text())
            seq = summary.get("mixture", {}).get("seq_len")
            if isinstance(seq, int) and seq > 0:
                return seq
        except (OSError, json.JSONDecodeError):
            pass
    cfg = model.config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 2048


def position_limit(model: nn.Module) -> int | None:
    """The number of positions the model can take, or None when they do not end (RoPE and other relative
    schemes: longer prompts run, whatever they score). Models with learned absolute position embeddings
    (GPT-2's ``n_positions``, OPT, ...) end there."""
    cfg = model.config
    rotary = any(getattr(cfg, k, None) for k in ("rope_parameters", "rope_theta", "rotary_pct", "rotary_dim",
                                                     "rope_scaling")) or getattr(cfg, "position_embedding_type",
                                                                                  None) == "rotary"
    if rotary:
        return None
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, nn.Embedding) and leaf in ("wpe", "embed_positions", "position_embeddings"):
            return int(mod.num_embeddings) - (2 if type(mod).__name__.startswith("OPT") else 0)
    v = getattr(cfg, "n_positions", None)
    return v if isinstance(v, int) else None


def _forward_params(model: nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def cache_keyword(model: nn.Module) -> str:
    """The keyword the model's forward takes its cache under, and its output returns it under: ``hybrid_cache``
    (the hybrid), ``cache`` (transformers >= 5.2x) or ``past_key_values`` (earlier)."""
    params = _forward_params(model)
    for key in ("hybrid_cache", "cache"):
        if key in params:
            return key
    return "past_key_values"


def takes_padding(model: nn.Module) -> bool:
    """False for models that refuse attention masks with zeros (the hybrid: a GDN state would absorb pads);
    those get equal-length batches only."""
    return cache_keyword(model) != "hybrid_cache"


def keeps_logits(model: nn.Module) -> bool:
    return "logits_to_keep" in _forward_params(model)


def check_tokenizer(model: nn.Module, tokenizer: Any) -> None:
    """A clear error when the tokenizer cannot be the model's: more tokens than embedding rows, or a
    different end-of-text id than the model's config says."""
    if tokenizer is None:
        raise ValueError("no tokenizer: pass tokenizer=... (the model's own), or a model name/folder to load both")
    rows = model.get_input_embeddings().weight.shape[0]
    n = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)
    if n is not None and n > rows:
        raise TokenizerMismatchError(f"the tokenizer has {n} tokens but the model's embedding has {rows} rows: "
                                     "it is not this model's tokenizer; pass the one saved with the model")
    want = getattr(model.config, "eos_token_id", None)
    have = getattr(tokenizer, "eos_token_id", None)
    if isinstance(want, int) and isinstance(have, int) and want != have:
        raise TokenizerMismatchError(f"the tokenizer's end-of-text id is {have} but the model's config says {want}: "
                                     "it is not this model's tokenizer; pass the one saved with the model")


def model_info(model: nn.Module) -> dict[str, Any]:
    """Name, fingerprint, dtype, device, lengths: what every result row carries about the model."""
    from headscope.mask import config_fingerprint

    p = next(model.parameters())
    return {"model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
            "model_type": getattr(model.config, "model_type", type(model).__name__),
            "fingerprint": config_fingerprint(model), "dtype": str(p.dtype).replace("torch.", ""),
            "device": str(p.device), "training_length": training_length(model),
            "position_limit": position_limit(model), "n_parameters": sum(x.numel() for x in model.parameters())}


def context_lengths(model: nn.Module, lengths: tuple[int, ...], multiples: tuple[float, ...]) -> list[int]:
    """Absolute ``lengths`` if given, else ``multiple * training length - ANSWER_ROOM`` for each multiple."""
    if lengths:
        return sorted(set(int(x) for x in lengths))
    train = training_length(model)
    return sorted({max(32, int(round(m * train)) - ANSWER_ROOM) for m in multiples})


def is_oom(err: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(err, oom):
        return True
    text = str(err).lower()
    return isinstance(err, (RuntimeError, MemoryError)) and ("out of memory" in text or "can't allocate" in text
                                                              or isinstance(err, MemoryError))


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fewer_rows_after_oom(call: Callable[["EvalContext"], T], ctx: "EvalContext", row_tokens: int,
                         device: torch.device) -> T:
    """``call(ctx)``; out of memory with several rows of ``row_tokens`` tokens per forward: freed memory and again
    with half as many rows per forward, down to one, before the caller gives the length up as out of memory."""
    rows = ctx.rows_per_batch(row_tokens)
    while True:
        try:
            return call(ctx)
        except Exception as err:  # noqa: BLE001
            if not is_oom(err) or rows == 1:
                raise
        free_memory(device)
        fewer = max(1, rows // 2)
        ctx.log(f"out of memory with {rows} rows of {row_tokens} tokens per forward; again with {fewer}")
        ctx, rows = dataclasses.replace(ctx, batch_size=fewer), fewer


def check_lengths_fit(model: nn.Module, length: int, extra: int = 16) -> str | None:
    """None if ``length`` (+ ``extra`` answer/decode tokens) fits the model's positions, else why not."""
    limit = position_limit(model)
    if limit is not None and length + extra > limit:
        return (f"the model has {limit} learned positions; a {length}-token prompt plus {extra} answer tokens "
                "does not fit (positions end)")
    return None
