"""Training configuration: frozen, validated dataclasses, loadable from a TOML (or YAML) file.

    run = TrainConfig.from_file("research/train_hybrid/reference.toml")

A file has top-level run fields, a ``[data]`` table (the mixture), an optional ``[hybrid]`` table
(``hybrid.HybridOptions``), an optional ``[model]`` table (the fresh model of the "pretrain" stage) and one
``[[stages]]`` table per stage, run in order. Unknown fields and impossible values are refused, naming the
field (``TrainConfigError``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from headscope.configs import from_dict
from hybrid.train.errors import TrainConfigError

__all__ = ["TrainConfigError", "DataConfig", "StageConfig", "ModelConfig", "TrainConfig", "LONG_FACTOR"]

LONG_FACTOR = 4  # a stage-3 stage ("long", "long_distill") trains at >= 4x the longest "align"/"distill" length


def _bad(owner: str, name: str, value: Any, why: str) -> None:
    raise TrainConfigError(f"{owner}.{name}={value!r}: {why}")


def _build(cls, data: Any, where: str):
    """``cls(**data)`` refusing unknown fields (named), for nested tables (``headscope.configs.from_dict``; TOML/JSON
    lists become the tuples the frozen dataclasses hold)."""
    try:
        return from_dict(cls, data, where=where, error=TrainConfigError, tuples=True)
    except TypeError as err:
        raise TrainConfigError(f"{where}: {err}") from None


def _source_weights(sources: Any) -> tuple[tuple[str, float], ...]:
    """``data.sources`` as sorted ``(name, weight)`` pairs, from a table {name: weight} or a list of pairs."""
    items = sources.items() if isinstance(sources, dict) else sources
    try:
        pairs = [(name, w) for name, w in items]
    except (TypeError, ValueError):
        _bad("data", "sources", sources, "give a table of source weights, e.g. [data.sources] gcide = 0.5")
    for name, w in pairs:
        if not isinstance(name, str) or not name:
            _bad("data", "sources", sources, f"source names are strings, got {name!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
            _bad("data", f"sources.{name}", w, "a source weight must be a number >= 0")
    if len({n for n, _ in pairs}) != len(pairs):
        _bad("data", "sources", sources, "a source is named twice")
    if pairs and sum(w for _, w in pairs) <= 0:
        _bad("data", "sources", sources, "the source weights sum to 0; give at least one positive weight")
    return tuple(sorted((n, float(w)) for n, w in pairs))


@dataclass(frozen=True)
class DataConfig:
    """The training mixture (relative weights) and its sources; lengths and batch sizes come from each stage."""

    # "heldout" / "train" (headscope.tasks.load_haystack), a path to a UTF-8 text file, or a corpus manifest
    # (data/corpus/manifest.json, python -m research.corpus.build: weighted sources, docs/corpus.md)
    corpus: str = "heldout"
    text: float = 0.25  # windows of the corpus
    # corpus = a manifest: {source: weight} of its training sources (a [data.sources] table; default: every training
    # source at the manifest's weight); held-out sources are refused when the corpus loads
    sources: tuple[tuple[str, float], ...] = ()
    teacher_corpus: str = ""  # text the teacher generated (python -m research.corpus.self_distill): folder or .txt
    teacher_corpus_share: float = 0.5  # with teacher_corpus: the fraction of the text rows cut from it
    niah: float = 0.4  # single-key NIAH prompts + answers (headscope.tasks)
    multikey: float = 0.15  # multi-key NIAH
    reasoning: float = 0.2  # the reasoning families, packed
    copy: float = 0.1  # repeated snippets (induction data)
    teacher: float = 0.0  # windows of text sampled from the teacher itself (hybrid stages only)
    teacher_samples: int = 64  # rows sampled from the teacher at each stage start (seeded), in one batch
    teacher_sample_len: int = 512  # tokens per sampled row; rows are concatenated and windows cut across them
    teacher_temperature: float = 1.0
    answer_weight: float = 5.0  # loss weight of the positions predicting answer tokens
    haystack_weight: float = 1.0  # loss weight of NIAH prompt tokens
    haystack: str = "heldout"  # NIAH haystack source (headscope.tasks.load_haystack)
    fast_niah: bool = False
    min_len: int = 0  # > 0: a length curriculum from min_len up to the stage's seq_len over `ramp` of the stage
    ramp: float = 0.0
    max_keys: int = 6
    binding_vars: tuple[int, int] = (4, 4)
    multikey_min_len: int = 0
    extra_queries: int = 0
    reasoning_families: tuple[str, ...] = ("arithmetic", "binding", "comparison", "two_hop")
    workers: int = 0  # DataLoader worker processes building batches (0: in the training process)
    # text rows: "random" (a window at a random token of a source) or "documents" (for long rows: a window from a
    # document's start, inside the document when it is long enough, else through the source's next documents;
    # hybrid.train.data.MixtureStream.document_window); windows never leave their source either way
    text_windows: str = "random"

    def __post_init__(self) -> None:
        weights = {k: getattr(self, k) for k in ("text", "niah", "multikey", "reasoning", "copy", "teacher")}
        for k, w in weights.items():
            if not isinstance(w, (int, float)) or w < 0:
                _bad("data", k, w, "mixture weights must be numbers >= 0")
        if sum(weights.values()) <= 0:
            raise TrainConfigError(f"data: the mixture weights {weights} sum to 0; give at least one positive weight")
        if self.teacher_samples < 1:
            _bad("data", "teacher_samples", self.teacher_samples, "must be >= 1")
        if self.teacher_sample_len < 1:
            _bad("data", "teacher_sample_len", self.teacher_sample_len, "must be >= 1")
        if not self.teacher_temperature > 0:
            _bad("data", "teacher_temperature", self.teacher_temperature, "must be > 0")
        if self.answer_weight < 0 or self.haystack_weight < 0:
            _bad("data", "answer_weight" if self.answer_weight < 0 else "haystack_weight",
                 min(self.answer_weight, self.haystack_weight), "loss weights must be >= 0")
        if self.min_len < 0:
            _bad("data", "min_len", self.min_len, "must be >= 0 (0: no length curriculum)")
        if not 0.0 <= self.ramp <= 1.0:
            _bad("data", "ramp", self.ramp, "must be in [0, 1]")
        if self.workers < 0:
            _bad("data", "workers", self.workers, "must be >= 0")
        object.__setattr__(self, "sources", _source_weights(self.sources))
        if self.sources and not str(self.corpus).endswith(".json"):
            _bad("data", "sources", dict(self.sources), "per-source weights need corpus = a corpus manifest "
                 "(data/corpus/manifest.json, written by python -m research.corpus.build)")
        if not isinstance(self.teacher_corpus, str):
            _bad("data", "teacher_corpus", self.teacher_corpus, "give the folder (or .txt) research.corpus."
                 "self_distill wrote, or leave it empty")
        share = self.teacher_corpus_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            _bad("data", "teacher_corpus_share", share, "must be a fraction in [0, 1]")
        from hybrid.train.data import TEXT_WINDOWS

        if self.text_windows not in TEXT_WINDOWS:
            _bad("data", "text_windows", self.text_windows, f"must be one of {TEXT_WINDOWS} (\"documents\": long "
                 "rows from a document's start)")

    def weights(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in ("text", "niah", "multikey", "reasoning", "copy", "teacher")}


@dataclass(frozen=True)
class StageConfig:
    """One stage: its registered name (``hybrid.train.STAGES``), length, batch, schedule and loss weights."""

    name: str
    steps: int
    lr: float
    seq_len: int = 512
    batch_size: int = 8  # global rows per step (split over processes)
    warmup_steps: int = 0
    decay_steps: int | None = None  # cosine from lr to min_lr_ratio * lr over these steps after warmup, then constant
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global grad norm (0: no clipping)
    kl_weight: float = 1.0  # "distill", "long_distill": weight of KL(teacher || student)
    ce_weight: float = 0.2  # "distill", "long_distill": weight of next-token cross-entropy
    temperature: float = 1.0  # "distill", "long_distill": KL temperature (scaled by T^2)
    # "long_distill": the KL to the teacher counts on each row's first kl_positions positions, where the teacher runs
    # (0: the teacher's max_position_embeddings; more is refused when the stage starts); the CE on every position
    kl_positions: int = 0
    # "distill": lm_head + KL + CE fused in chunks of tokens, no [B, T, V] logits (hybrid.train.fused_loss);
    # "auto" = on for CUDA batches unless FSDP shards the lm_head, "on" (refused under FSDP), "off" (the naive path)
    fused_loss: str = "auto"
    head_drop: float = 0.0  # "pretrain": head dropout probability (hybrid.train.head_dropout)
    max_minutes: float = 0.0  # > 0: a time budget; the stage ends at `steps` or when the budget is used, and the
    #                           schedule and length curriculum follow the larger fraction (not bit-reproducible)
    data: DataConfig | None = None  # this stage's mixture (default: the run's [data])
    # the learning rate after warm-up: "cosine" (to min_lr_ratio * lr over decay_steps, then constant) or "constant"
    # (lr until the stage ends: the method's final long stage)
    schedule: str = "cosine"
    # "align": also train the GDN heads' q/k/v projections and the GDN branch's q/k norms, which the conversion
    # copied from the teacher (stage 1 then trains every part that replaced an attention head); False: only the
    # parameters the hybrid adds (hybrid.train.stages.new_parameter_names). Other stages train everything anyway.
    train_gdn_qkv: bool = True
    # "align": also train the FA heads' q/k projections and q/k norms (copied from the teacher; without RoPE on the
    # FA heads they have to relearn where they attend). False: they wait for stage 2, as every teacher weight does.
    train_fa_qk: bool = False
    # "align": what each student layer reads. "student": the output of the student's own layer below (the hybrid
    # runs end to end, so a layer's error reaches every layer above it); "teacher": the teacher's input to the same
    # layer (each layer is matched on the teacher's hidden state alone, no error carried between layers)
    align_inputs: str = "student"
    # "distill_on_policy": the last on_policy_tokens of every row are the student's own continuation of the rest
    # (sampled at sample_temperature, 0 = greedy, without gradient), and the KL to the teacher counts on them too
    on_policy_tokens: int = 0
    sample_temperature: float = 1.0
    # rows per forward/backward pass on each process (0: the process's whole share of batch_size in one pass). A
    # smaller value splits each step's batch into passes whose gradients add up before the optimizer step, each term
    # divided by the whole batch's count: the same step in less memory (stage 2 of the SmolLM2 recipes at batch 64
    # needs ~95 GiB in one pass, ~50 at 32). How the step is computed, not what: left out of the fingerprint.
    micro_batch_size: int = 0

    def __post_init__(self) -> None:
        from hybrid.train.stages import STAGES

        where = f"stages[{self.name}]"
        if self.name not in STAGES:
            _bad(where, "name", self.name, f"not a registered stage; known: {sorted(STAGES)}")
        for k in ("steps", "seq_len", "batch_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _bad(where, k, v, "must be a positive int")
        if self.seq_len < 16:
            _bad(where, "seq_len", self.seq_len, "must be >= 16")
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            _bad(where, "lr", self.lr, "the learning rate must be > 0")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            _bad(where, "warmup_steps", self.warmup_steps, "must be an int >= 0")
        if self.decay_steps is not None and (not isinstance(self.decay_steps, int) or self.decay_steps < 0):
            _bad(where, "decay_steps", self.decay_steps, "must be an int >= 0 (or left out: to the end)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _bad(where, "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        if self.weight_decay < 0:
            _bad(where, "weight_decay", self.weight_decay, "must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            _bad(where, "betas", self.betas, "give two numbers in [0, 1)")
        if self.grad_clip < 0:
            _bad(where, "grad_clip", self.grad_clip, "must be >= 0 (0: no clipping)")
        if self.kl_weight < 0 or self.ce_weight < 0 or self.kl_weight + self.ce_weight <= 0:
            _bad(where, "kl_weight", (self.kl_weight, self.ce_weight), "kl_weight, ce_weight must be >= 0, not both 0")
        if not self.temperature > 0:
            _bad(where, "temperature", self.temperature, "must be > 0")
        from hybrid.train.stages import FUSED_LOSS

        if self.fused_loss not in FUSED_LOSS:
            _bad(where, "fused_loss", self.fused_loss, f"must be one of {FUSED_LOSS}")
        if self.fused_loss == "on" and self.name not in ("distill", "distill_on_policy"):
            _bad(where, "fused_loss", self.fused_loss, "the fused loss is a 'distill' option (the other stages "
                 "compute their loss from the logits); leave it 'auto'")
        if not 0.0 <= self.head_drop < 1.0:
            _bad(where, "head_drop", self.head_drop, "must be in [0, 1)")
        if self.name == "distill_on_policy":
            if not isinstance(self.on_policy_tokens, int) or not 1 <= self.on_policy_tokens < self.seq_len:
                _bad(where, "on_policy_tokens", self.on_policy_tokens, f"the student's own tokens per row: an int "
                     f"in [1, seq_len) = [1, {self.seq_len}) (the rest of the row is the prompt it continues)")
            if not self.kl_weight > 0:
                _bad(where, "kl_weight", self.kl_weight, "the on-policy stage learns from the KL on the student's "
                     "own tokens: kl_weight must be > 0")
        elif self.on_policy_tokens != 0:
            _bad(where, "on_policy_tokens", self.on_policy_tokens, "an option of the 'distill_on_policy' stage; "
                 "leave it out here")
        if not isinstance(self.kl_positions, int) or isinstance(self.kl_positions, bool) or self.kl_positions < 0:
            _bad(where, "kl_positions", self.kl_positions, "must be an int >= 0 (the positions where the KL to the "
                 "teacher counts; 0: the teacher's max_position_embeddings)")
        if self.kl_positions and self.name != "long_distill":
            _bad(where, "kl_positions", self.kl_positions, "an option of the 'long_distill' stage; leave it out here")
        if not isinstance(self.sample_temperature, (int, float)) or self.sample_temperature < 0:
            _bad(where, "sample_temperature", self.sample_temperature, "must be >= 0 (0: greedy)")
        if not isinstance(self.micro_batch_size, int) or isinstance(self.micro_batch_size, bool) \
                or self.micro_batch_size < 0:
            _bad(where, "micro_batch_size", self.micro_batch_size, "must be an int >= 0 (0: the whole batch in one "
                 "pass)")
        if self.micro_batch_size and self.batch_size % self.micro_batch_size:
            _bad(where, "micro_batch_size", self.micro_batch_size, f"must divide batch_size={self.batch_size} (a "
                 "step's rows in passes of equal size)")
        if self.micro_batch_size and STAGES[self.name].counts is None:
            _bad(where, "micro_batch_size", self.micro_batch_size, f"stage {self.name!r} cannot give its loss's "
                 "counts before it runs, which splitting a batch needs; leave micro_batch_size out (0)")
        if not self.max_minutes >= 0:
            _bad(where, "max_minutes", self.max_minutes, "must be >= 0 (0: no time budget)")
        if self.data is not None and not isinstance(self.data, DataConfig):
            object.__setattr__(self, "data", _build(DataConfig, self.data, f"{where}.data"))
        if self.schedule not in SCHEDULES:
            _bad(where, "schedule", self.schedule, f"must be one of {SCHEDULES} (\"cosine\": decay after warm-up; "
                 "\"constant\": lr after warm-up until the stage ends)")
        if self.schedule == "constant" and self.decay_steps is not None:
            _bad(where, "decay_steps", self.decay_steps, "a constant schedule does not decay: leave decay_steps out, "
                 "or use schedule = \"cosine\"")
        if not isinstance(self.train_gdn_qkv, bool):
            _bad(where, "train_gdn_qkv", self.train_gdn_qkv, "must be true or false")
        if not isinstance(self.train_fa_qk, bool):
            _bad(where, "train_fa_qk", self.train_fa_qk, "must be true or false")
        if self.train_fa_qk and self.name != "align":
            _bad(where, "train_fa_qk", self.train_fa_qk, f"stage {self.name!r} trains every parameter; "
                 "train_fa_qk = true is an 'align' option (stage 1 then trains the FA heads' q/k too)")
        if self.align_inputs not in ALIGN_INPUTS:
            _bad(where, "align_inputs", self.align_inputs, f"must be one of {list(ALIGN_INPUTS)}")
        if self.align_inputs != "student" and self.name != "align":
            _bad(where, "align_inputs", self.align_inputs, f"stage {self.name!r} has no per-layer loss; "
                 "align_inputs is an 'align' option (what each layer reads while stage 1 matches it)")
        if not self.train_gdn_qkv and self.name != "align":
            _bad(where, "train_gdn_qkv", self.train_gdn_qkv, f"stage {self.name!r} trains every parameter; "
                 "train_gdn_qkv = false is an 'align' option (stage 1 then trains only the new parameters)")

    def lr_at(self, step: int) -> float:
        """Linear warmup over warmup_steps; then ``schedule`` "cosine": cosine to min_lr_ratio * lr over
        decay_steps, then constant; "constant": lr."""
        import math

        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        decay = self.steps - self.warmup_steps if self.decay_steps is None else self.decay_steps
        t = 1.0 if decay == 0 else min(1.0, (step - self.warmup_steps) / decay)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass(frozen=True)
class ModelConfig:
    """The fresh Qwen3-architecture model that the "pretrain" stage trains (the reference model's shape)."""

    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    init_from: str | None = None  # start from this saved model folder instead of a fresh init

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "init_from" and not v > 0:
                _bad("model", f.name, v, "must be > 0")
        if self.num_attention_heads % self.num_key_value_heads:
            _bad("model", "num_key_value_heads", self.num_key_value_heads,
                 f"must divide num_attention_heads={self.num_attention_heads}")


SCHEDULES = ("cosine", "constant")  # StageConfig.schedule
ALIGN_INPUTS = ("student", "teacher")  # StageConfig.align_inputs
DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTED = ("auto", "ddp", "fsdp")


# TrainConfig fields added after runs were made: left out of the fingerprint at these values (resume stays valid)
_LATER_DEFAULTS = {"working_dtype": "float32", "teacher_dtype": "float32"}
# DataConfig fields added later: left out of to_dict (so of the fingerprint) at these values, as JSON writes them
_LATER_DATA_DEFAULTS = {"sources": [], "teacher_corpus": "", "teacher_corpus_share": 0.5, "text_windows": "random"}
# StageConfig fields added later: left out of to_dict (so of the fingerprint) at these values
_LATER_STAGE_DEFAULTS = {"schedule": "cosine", "on_policy_tokens": 0, "sample_temperature": 1.0, "train_fa_qk": False,
                         "align_inputs": "student", "micro_batch_size": 0, "kl_positions": 0}
# train_gdn_qkv: stages before it trained the GDN q/k/v in every stage but "align" (where they stayed frozen). So
# to_dict leaves it out of the stages where it has no effect (every one but "align", where it is always true), and
# the fingerprint also leaves it out of an "align" stage that keeps the former behaviour (false): runs made before
# the field existed resume under a config that pins it false. An "align" stage without the field now trains them.
# fields under their older names (a file may still use them; the fingerprint hashes the older names, so runs made
# under them keep their fingerprint): current name -> older name
_FORMER_NAMES = {"calibrate_merge": "calibrate_fusion"}


@dataclass(frozen=True)
class TrainConfig:
    """A whole run: sources, stages in order, and the bookkeeping (checkpoints, logs, evaluations)."""

    out: str
    stages: tuple[StageConfig, ...]
    teacher: str | None = "default"  # headscope.load_model name or a model folder (hybrid stages)
    mask: str | None = None  # head-mask JSON (headscope); needed by the hybrid stages
    tokenizer: str | None = None  # default: the teacher's (or model.init_from's / headscope's default)
    seed: int = 0
    device: str = "auto"
    distributed: str = "auto"  # "auto" = "ddp" when torchrun started several processes; "fsdp": shard the models
    data: DataConfig = field(default_factory=DataConfig)
    hybrid: dict = field(default_factory=dict)  # hybrid.HybridOptions fields
    # a fresh hybrid's merge gammas set to the teacher's per-head output RMS (hybrid.calibrate_merge) on the first
    # stage's corpus before training; False: gamma_init (1), which on SmolLM2 leaves the hybrid's logits far from the
    # teacher's at step 0 (KL 11 vs 0.8 with every head FA: docs/training.md)
    calibrate_merge: bool = True  # older name: calibrate_fusion (read as this)
    # torch.compile each decoder layer of the student (hybrid.train.build.compile_decoder_layers) before training:
    # the first step of each new shape compiles; not with distributed = "fsdp"; not part of the fingerprint
    compile: bool = False
    # the student's parameters while a stage trains: "float32" (autocast casts each weight on every use) or
    # "bfloat16" (bf16 working weights, float32 masters in the optimizer: hybrid.train.precision; evaluations inside
    # a stage run the bf16 copies, and under DDP the gradients are all-reduced in bf16); not with FSDP
    working_dtype: str = "float32"
    # the frozen teacher's parameters ("bfloat16": the weight casts autocast makes anyway, made once; buffers such as
    # RoPE's inv_freq stay float32; also for its text sampling and the merge calibration, which run the teacher)
    teacher_dtype: str = "float32"
    # torch.compile the decoder layers of a copy of the teacher that the stage losses run (its text sampling keeps
    # the eager teacher: a new shape at every decode step); not with FSDP; not part of the fingerprint
    compile_teacher: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    checkpoint_every: int = 0  # steps; 0: only at each stage end
    keep_checkpoints: int = 2
    log_every: int = 10
    eval_every: int = 0  # steps; 0: only at each stage end
    eval: str = "default"  # the in-run check, a name in hybrid.train.CHECKS ("none" to skip)
    eval_samples: int = 16
    threads: int = 0  # torch threads on CPU (0: leave torch's default)
    progress: bool = True  # tqdm bars

    def __post_init__(self) -> None:
        if not isinstance(self.out, str) or not self.out:
            _bad("run", "out", self.out, "give the output folder")
        stages = self.stages
        if isinstance(stages, (list, tuple)):
            stages = tuple(_build(StageConfig, s, f"stages[{i}]") for i, s in enumerate(stages))
            object.__setattr__(self, "stages", stages)
        if not stages:
            _bad("run", "stages", self.stages, "give at least one [[stages]] table")
        object.__setattr__(self, "data", _build(DataConfig, self.data, "data"))
        object.__setattr__(self, "model", _build(ModelConfig, self.model, "model"))
        if not isinstance(self.hybrid, dict):
            _bad("run", "hybrid", self.hybrid, "give a table of hybrid.HybridOptions fields")
        from hybrid.config import HybridConfigError, HybridOptions, upgrade_options

        try:
            object.__setattr__(self, "hybrid", upgrade_options(self.hybrid))  # the older key "fusion" -> "merge"
            HybridOptions.from_dict(self.hybrid)
        except HybridConfigError as err:
            raise TrainConfigError(f"hybrid: {err}") from None
        if self.device not in DEVICES:
            _bad("run", "device", self.device, f"must be one of {DEVICES}")
        if self.distributed not in DISTRIBUTED:
            _bad("run", "distributed", self.distributed, f"must be one of {DISTRIBUTED}")
        for k in ("checkpoint_every", "log_every", "eval_every", "threads"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 0:
                _bad("run", k, v, "must be an int >= 0")
        if self.log_every < 1:
            _bad("run", "log_every", self.log_every, "must be >= 1")
        if self.keep_checkpoints < 1:
            _bad("run", "keep_checkpoints", self.keep_checkpoints, "must be >= 1")
        if self.eval_samples < 1:
            _bad("run", "eval_samples", self.eval_samples, "must be >= 1")
        from hybrid.train.evals import CHECKS

        if self.eval not in CHECKS:
            _bad("run", "eval", self.eval, f"not a registered evaluation check (hybrid.train.CHECKS); known: "
                 f"{sorted(CHECKS)}")
        from hybrid.train.stages import STAGES, transfer_lengths

        names = [s.name for s in stages]
        hybrid_stages = [n for n in names if STAGES[n].hybrid]
        if hybrid_stages and len(hybrid_stages) != len(names):
            _bad("run", "stages", names, "a run trains either a hybrid (align/distill/long) or a fresh model "
                 "(pretrain), not both")
        if hybrid_stages and not self.mask:
            _bad("run", "mask", self.mask, f"stages {hybrid_stages} build a hybrid: give the head-mask JSON")
        if hybrid_stages and not self.teacher:
            _bad("run", "teacher", self.teacher, "the hybrid stages need a teacher (a name or a model folder)")
        short = transfer_lengths(stages)
        for s in stages:
            if STAGES[s.name].number == 3 and short and s.seq_len < LONG_FACTOR * max(short):
                _bad(f"stages[{s.name}]", "seq_len", s.seq_len,
                     f"stage 3 ({s.name!r}) must train at >= {LONG_FACTOR}x the align/distill length "
                     f"({max(short)}), i.e. seq_len >= {LONG_FACTOR * max(short)}")
        if not isinstance(self.compile, bool):
            _bad("run", "compile", self.compile, "must be true or false")
        if self.compile and self.distributed == "fsdp":
            _bad("run", "compile", self.compile, "compiling FSDP-wrapped layers is not supported here; use "
                 "distributed = 'ddp' or compile = false")
        from hybrid.train.precision import WORKING_DTYPES

        for k in ("working_dtype", "teacher_dtype"):
            if getattr(self, k) not in WORKING_DTYPES:
                _bad("run", k, getattr(self, k), f"must be one of {sorted(WORKING_DTYPES)}")
        if self.working_dtype != "float32" and self.distributed == "fsdp":
            _bad("run", "working_dtype", self.working_dtype, "FSDP keeps its own parameter dtypes; use "
                 "distributed = 'ddp' or working_dtype = 'float32'")
        if not isinstance(self.compile_teacher, bool):
            _bad("run", "compile_teacher", self.compile_teacher, "must be true or false")
        if self.compile_teacher and self.distributed == "fsdp":
            _bad("run", "compile_teacher", self.compile_teacher, "not with distributed = 'fsdp' (the teacher is "
                 "sharded); use 'ddp' or compile_teacher = false")
        if (self.compile_teacher or self.teacher_dtype != "float32") and not hybrid_stages:
            _bad("run", "compile_teacher" if self.compile_teacher else "teacher_dtype",
                 self.compile_teacher if self.compile_teacher else self.teacher_dtype,
                 "only the hybrid stages (align/distill/long) have a teacher")
        for s in stages:
            if s.fused_loss == "on" and self.distributed == "fsdp":
                _bad(f"stages[{s.name}]", "fused_loss", s.fused_loss, "FSDP shards the lm_head weight, which the "
                     "fused loss needs whole; use 'auto' (the naive path under FSDP) or 'off', or distributed='ddp'")
        for s in stages:
            if s.name != "pretrain" and s.head_drop:
                _bad(f"stages[{s.name}]", "head_drop", s.head_drop, "head dropout is a 'pretrain' option")

    # ---- helpers --------------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        from hybrid.train.stages import STAGES

        return STAGES[self.stages[0].name].hybrid

    def data_for(self, stage: StageConfig) -> DataConfig:
        return stage.data if stage.data is not None else self.data

    def to_dict(self) -> dict[str, Any]:
        d = json.loads(json.dumps(dataclasses.asdict(self), default=list))
        for data in [d["data"], *(s["data"] for s in d["stages"] if s.get("data"))]:
            for k, v in _LATER_DATA_DEFAULTS.items():  # the same dict (and fingerprint) as before they existed
                if data.get(k) == v:
                    del data[k]
        for s in d["stages"]:
            for k, v in _LATER_STAGE_DEFAULTS.items():
                if s.get(k) == v:
                    del s[k]
            if s["name"] != "align" and s.get("train_gdn_qkv") is True:  # no effect outside stage 1
                del s["train_gdn_qkv"]
        return d

    def fingerprint(self, ignore: tuple[str, ...] = ("out", "device", "threads", "progress", "log_every",
                                                      "distributed", "compile", "compile_teacher"),
                    ignore_stage: tuple[str, ...] = ("fused_loss", "micro_batch_size")) -> str:
        """sha256 of the settings that change the result (bookkeeping-only fields left out: ``ignore`` of the run,
        ``ignore_stage`` of each stage, e.g. how the loss is computed), 16 hex digits. The fields added later
        (``_LATER_DEFAULTS``) count only when set away from their default, so runs made before they existed keep
        their fingerprint."""
        d = {_FORMER_NAMES.get(k, k): v for k, v in self.to_dict().items()
             if k not in ignore and not (k in _LATER_DEFAULTS and v == _LATER_DEFAULTS[k])}
        d["stages"] = [{k: v for k, v in s.items() if k not in ignore_stage
                        and not (k == "train_gdn_qkv" and v is False)}  # the former "align" (_LATER_STAGE_DEFAULTS)
                       for s in d["stages"]]
        if "hybrid" in d:  # the merge option under its older name (_FORMER_NAMES' reason)
            from hybrid.layers.merge import FORMER_NAME

            d["hybrid"] = {(FORMER_NAME if k == "merge" else k): v for k, v in d["hybrid"].items()}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        data = dict(data)
        if "stages" not in data:
            raise TrainConfigError("config: no [[stages]] tables; give at least one stage")
        for new, old in _FORMER_NAMES.items():  # a field under its older name
            if old in data:
                if new in data and data[new] != data[old]:
                    raise TrainConfigError(f"config: both {new}={data[new]!r} and its older name "
                                           f"{old}={data[old]!r}; keep {new} only")
                data[new] = data.pop(old)
        return _build(cls, data, "config")

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        """A config from a .toml file (stdlib tomllib), or .yaml/.yml when pyyaml is importable, or .json."""
        p = Path(path)
        if not p.exists():
            raise TrainConfigError(f"config file {p} does not exist")
        suffix = p.suffix.lower()
        if suffix == ".toml":
            import tomllib

            try:
                data = tomllib.loads(p.read_text(encoding="utf-8"))
            except tomllib.TOMLDecodeError as err:
                raise TrainConfigError(f"config file {p} is not valid TOML: {err}") from None
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise TrainConfigError(f"config file {p}: YAML needs pyyaml (pip install pyyaml); "
                                       "or use TOML") from None
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        elif suffix == ".json":
            data = json.loads(p.read_text(encoding="utf-8"))
        else:
            raise TrainConfigError(f"config file {p}: give a .toml (or .yaml / .json) file")
        if not isinstance(data, dict):
            raise TrainConfigError(f"config file {p}: the top level must be a table")
        data.update(overrides)
        return cls.from_dict(data)
