"""What a study trains: the teacher's selection scores (computed once), and variants, each a recipe for a head
mask plus hybrid options, by kind (a named registry ``VARIANT_KINDS``; a new kind is one entry + a test).

    scores = selection_scores(teacher, tok, path="runs/studies/scores.json")   # NIAH + reasoning, fused; cached
    spec = VariantSpec(name="global-kv", kind="select", strategy="global", unit="kv_group", fraction=1 / 8)
    built = build_variant(spec, teacher, scores=scores, seed=0)   # built.mask, built.options, built.info

Kinds:
- "select": ``headscope.select(scores, strategy=..., unit=..., fraction=... | ratio=... | k=...)``; strategies
  that ignore scores (the random and fixed baselines) get none, so they need no scoring. ``unit="head"`` counts
  the budget in FA query heads, ``unit="kv_group"`` in whole KV groups (the KV cache share). A budget the strategy
  cannot meet exactly (e.g. one FA unit per layer with fewer units than layers) is infeasible: ``build_variant``
  raises ``InfeasibleVariant`` naming why.
- "layerwise": whole FA layers evenly spaced (``hybrid.builders.layerwise_mask``, ratio "LA:FA"),
  ``granularity="layer"``.
- "token": every head sliding-window attention (``window`` keys) + Gated DeltaNet (``granularity="token"``).
- "teacher": no hybrid; the teacher itself (evaluated, not trained).
- "tuned_teacher": the teacher trained like the hybrids: a "hybrid" with every head FA, the teacher's RoPE kept,
  no log scale, no output gate and no merge norm (``hybrid.from_mask`` then computes the teacher's function and adds no
  parameter), trained by the study's stages that train the whole model (stage 1 trains new parameters only, so
  it is skipped: ``VariantKind.new_parameters`` False). The fair baseline of a hybrid's retention: the same
  data, objective and steps, without the conversion.
- "learned": a learned selector (``research.studies.selector``: a static gate per head mixing the teacher's own
  attention with a GDN branch, trained layer-locally against the teacher under an FA-budget penalty), then the
  top gates at the budget through ``headscope.select`` (``strategy`` ranks them, default "global"; ``unit`` and
  fraction / ratio / k as for "select"). It needs training data (``needs_data``): ``build_variant``'s
  ``context`` (a ``BuildContext``: the tokenizer, the study's data mixture, the device, a folder where the gates
  are cached so a resumed study reuses them); the variant's ``selector`` table holds ``SelectorConfig`` fields
  over the context's (the study's ``[selector]``). The mask's settings say strategy "learned".
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from headscope.configs import from_dict
from headscope.registry import Registry

__all__ = ["VariantSpec", "VariantKind", "BuiltVariant", "BuildContext", "InfeasibleVariant", "VARIANT_KINDS",
           "build_variant", "selection_scores", "make_mask", "mask_shares"]


class InfeasibleVariant(ValueError):
    """A variant whose budget its strategy cannot meet on this teacher (the message says why)."""


@dataclass(frozen=True)
class VariantSpec:
    """One variant of a study: a name, the studies it belongs to, its kind and the kind's fields, and hybrid
    options (``hybrid.HybridOptions`` fields) on top of the study's shared ones."""

    name: str
    kind: str = "select"
    studies: tuple[int, ...] = ()
    label: str = ""  # a longer description for tables (default: the name)
    strategy: str = "global"  # kind "select" / "learned": a name in headscope.selection.STRATEGIES
    unit: str = "head"  # kind "select" / "learned": "head" (FA query heads) or "kv_group" (KV cache share)
    fraction: float | None = None  # kind "select" / "learned": the budget (one of fraction / ratio / k)
    ratio: str | None = None  # "select" (LA:FA budget) or "layerwise" (LA:FA layers, e.g. "3:1")
    k: int | None = None
    window: int = 512  # kind "token": keys per query of the sliding window (its KV cache holds window - 1)
    hybrid: dict = field(default_factory=dict)  # HybridOptions overrides of this variant
    selector: dict = field(default_factory=dict)  # kind "learned": SelectorConfig fields (over the study's)
    seeds: tuple[int, ...] | None = None  # the study's seeds this variant runs with (None: all of them)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"variant {self.name!r}: {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.name, str) or not self.name or not self.name.replace("-", "").replace(
                "_", "").replace(".", "").isalnum():
            raise ValueError(f"variant name {self.name!r}: give a non-empty word (letters, digits, '-', '_', '.'), "
                             "it names a folder")
        if self.kind not in VARIANT_KINDS:
            bad("kind", f"not one of {list(VARIANT_KINDS)}")
        object.__setattr__(self, "studies", tuple(int(s) for s in self.studies))
        if not isinstance(self.hybrid, dict):
            bad("hybrid", "give a table of hybrid.HybridOptions fields")
        if self.seeds is not None:
            if isinstance(self.seeds, (str, int)) or not self.seeds or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in self.seeds):
                bad("seeds", "give a non-empty list of ints >= 0 (a subset of the study's seeds), or leave it out")
            object.__setattr__(self, "seeds", tuple(self.seeds))
        if self.kind in ("select", "learned"):
            from headscope.selection import STRATEGIES, UNITS

            if self.strategy not in STRATEGIES:
                bad("strategy", f"not a selection strategy; known: {list(STRATEGIES)}")
            if self.kind == "learned" and not STRATEGIES.entry(self.strategy).uses_scores:
                bad("strategy", "a learned variant ranks its gates: give a strategy that uses scores ("
                    f"{[n for n in STRATEGIES if STRATEGIES.entry(n).uses_scores]})")
            if self.unit not in UNITS:
                bad("unit", f"must be one of {UNITS}")
            given = [n for n in ("fraction", "ratio", "k") if getattr(self, n) is not None]
            if len(given) != 1:
                raise ValueError(f"variant {self.name!r}: give exactly one budget of fraction / ratio / k "
                                 f"(got {given or 'none'})")
        if not isinstance(self.selector, dict):
            bad("selector", "give a table of research.studies.selector.SelectorConfig fields")
        if self.selector and self.kind != "learned":
            bad("selector", "only a variant of kind 'learned' trains a selector")
        if self.selector:
            from research.studies.selector import SelectorConfig

            try:
                SelectorConfig.from_dict(self.selector)  # names a bad field and value now
            except ValueError as err:
                raise ValueError(f"variant {self.name!r}: selector: {err}") from None
        if self.kind == "layerwise" and self.ratio is None:
            bad("ratio", "a layer-wise variant needs ratio='LA:FA' (e.g. '3:1')")
        if self.kind == "token" and (not isinstance(self.window, int) or self.window < 2):
            bad("window", "give an int >= 2 (keys per query, the query included)")

    @property
    def needs_scores(self) -> bool:
        return VARIANT_KINDS[self.kind].needs_scores(self)

    @property
    def needs_data(self) -> bool:
        """The kind trains something to build its mask (``BuildContext`` with a tokenizer and data)."""
        return VARIANT_KINDS[self.kind].needs_data(self)

    @property
    def trains(self) -> bool:
        return self.kind != "teacher"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["studies"] = list(self.studies)
        if self.seeds is not None:
            d["seeds"] = list(self.seeds)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VariantSpec":
        return from_dict(cls, data, where=f"variant {data.get('name')!r}")


@dataclass
class BuiltVariant:
    mask: Any  # a headscope.HeadMask, or None for the teacher
    options: dict[str, Any]  # HybridOptions overrides (granularity, window, ...) added by the kind
    info: dict[str, Any]  # FA query-head share, KV share at the training length, layers with FA, ...


@dataclass
class BuildContext:
    """What a kind that trains to build its mask needs (kind "learned"); the other kinds ignore it."""

    tokenizer: Any = None
    data: Any = None  # a hybrid.train.DataConfig: the study's training mixture
    device: Any = None  # where to train (None: the teacher's device); the teacher is moved there and back
    folder: Any = None  # where a kind caches what it learned (the variant's folder); None: no cache
    selector: dict = field(default_factory=dict)  # SelectorConfig fields shared by the study's learned variants
    hybrid: dict = field(default_factory=dict)  # the HybridOptions the variant is trained with (build_variant's)


@dataclass(frozen=True)
class VariantKind:
    # (spec, teacher, scores, seed, context: BuildContext | None) -> (mask, hybrid options)
    build: Callable[[VariantSpec, Any, Any, int, Any], tuple[Any, dict[str, Any]]]
    needs_scores: Callable[[VariantSpec], bool] = lambda spec: False
    doc: str = ""
    needs_data: Callable[[VariantSpec], bool] = lambda spec: False
    new_parameters: bool = True  # False: the model has no new parameters, so stages that train only those are skipped
    # a variant's row label in the study tables (research.studies.metrics), from its saved spec (VariantSpec.to_dict)
    describe: Callable[[dict], str] = lambda v: "teacher"


VARIANT_KINDS: Registry[VariantKind] = Registry("variant kind")


def _select(spec: VariantSpec, teacher, scores, seed: int, context=None):
    from headscope.mask import model_shape
    from headscope.selection import STRATEGIES, select

    entry = STRATEGIES.entry(spec.strategy)
    if entry.uses_scores:
        if scores is None:
            raise ValueError(f"variant {spec.name!r}: strategy {spec.strategy!r} ranks heads: give scores")
        src = scores
    else:  # the baselines ignore the scores: an all-zero map, so they need no scoring
        s = model_shape(teacher)
        src = torch.zeros(s["num_hidden_layers"], s["num_attention_heads"])  # [L, H]
    try:
        mask = select(src, fraction=spec.fraction, ratio=spec.ratio, k=spec.k, strategy=spec.strategy, unit=spec.unit,
                      seed=seed if not entry.uses_scores else None, model=teacher)
    except ValueError as err:
        raise InfeasibleVariant(str(err)) from None
    want = mask.settings.get("k_budget", mask.settings["k"])
    per = mask.n_heads // mask.n_kv_heads if spec.unit == "kv_group" else 1
    if len(mask.fa_heads) != want * per:  # e.g. fixed_ratio: the same units in every layer overshoot the budget
        what = "KV groups" if spec.unit == "kv_group" else "query heads"
        raise InfeasibleVariant(f"strategy {spec.strategy!r} keeps {len(mask.fa_heads) // per} {what}, not the "
                                f"budget's {want}: it cannot meet this budget on this model "
                                f"({mask.n_layers} layers x {mask.n_heads // per} {what})")
    return mask, {}


def _layerwise(spec: VariantSpec, teacher, scores, seed: int, context=None):
    from hybrid.builders import layerwise_mask

    return layerwise_mask(teacher, spec.ratio), {"granularity": "layer"}


def _token(spec: VariantSpec, teacher, scores, seed: int, context=None):
    from headscope.mask import HeadMask

    mask = HeadMask.for_model(teacher, [], settings={"strategy": "token", "window": spec.window})
    return mask, {"granularity": "token", "window": spec.window}


def _teacher(spec: VariantSpec, teacher, scores, seed: int, context=None):
    return None, {}


def _tuned_teacher(spec: VariantSpec, teacher, scores, seed: int, context=None):
    from hybrid.builders import TEACHER_OPTIONS, teacher_mask  # hybrid.from_teacher's mask and options

    return teacher_mask(teacher, settings={"strategy": "all_fa"}), dict(TEACHER_OPTIONS)


def _same_key(cached: Any, key: dict[str, Any], teacher) -> bool:
    """A cache key recorded for this teacher: ``key``, or ``key`` with the teacher's legacy fingerprint (caches
    written before the fingerprint hashed RoPE settings are reused)."""
    from headscope.mask import legacy_config_fingerprint

    return cached == key or cached == {**key, "teacher": legacy_config_fingerprint(teacher)}


SELECTOR_FILE = "selector.json"  # the learned gates, in the variant's folder (reused while the key matches)


def _learned(spec: VariantSpec, teacher, scores, seed: int, context=None):
    """Train the selector (or reuse its cached gates), then the top gates at the spec's budget."""
    from headscope.io import write_text
    from headscope.mask import config_fingerprint, model_shape
    from headscope.selection import budget
    from research.studies.selector import SelectorConfig, SelectorResult, mixture_batches, selector_mask, train_selector

    if context is None or context.tokenizer is None or context.data is None:
        raise ValueError(f"variant {spec.name!r}: kind 'learned' trains a selector: give build_variant a "
                         "context=BuildContext(tokenizer=..., data=DataConfig(...))")
    s = model_shape(teacher)
    L, H, K = s["num_hidden_layers"], s["num_attention_heads"], s["num_key_value_heads"]
    G = K if spec.unit == "kv_group" else H
    try:
        share = budget(L * G, spec.k, spec.fraction, spec.ratio) / (L * G)  # the FA share the penalty aims at
    except (ValueError, TypeError) as err:
        raise InfeasibleVariant(str(err)) from None
    cfg = SelectorConfig.from_dict({"seed": seed, "budget": share, "gate_unit": spec.unit,
                                    **context.selector, **spec.selector})
    options = {**context.hybrid}
    data = context.data.to_dict() if hasattr(context.data, "to_dict") else json.loads(json.dumps(
        asdict(context.data), default=list))
    key = {"teacher": config_fingerprint(teacher), "selector": {**cfg.to_dict(), "progress": None},
           "hybrid": options, "data": data}
    path = Path(context.folder) / SELECTOR_FILE if context.folder is not None else None
    result = None
    if path is not None and path.exists():
        cached = json.loads(path.read_text())
        if _same_key(cached.get("key"), key, teacher):
            result = SelectorResult.from_dict(cached["result"])
            print(f"[selector] {spec.name}: gates reused from {path}", flush=True)
    if result is None:
        home = next(teacher.parameters()).device
        device = torch.device(context.device) if context.device is not None else home
        try:
            teacher.to(device)
            batches = mixture_batches(context.data, context.tokenizer, cfg.seq_len, cfg.batch_size, cfg.seed)
            result = train_selector(teacher, batches, cfg, options)
        finally:
            teacher.to(home)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if path is not None:
            write_text(path, json.dumps({"key": key, "result": result.to_dict()}, indent=1, default=str))
    try:
        mask = selector_mask(result, teacher, fraction=spec.fraction, ratio=spec.ratio, k=spec.k, unit=spec.unit,
                             strategy=spec.strategy)
    except ValueError as err:
        raise InfeasibleVariant(str(err)) from None
    return mask, {}


def _uses_scores(spec: VariantSpec) -> bool:
    from headscope.selection import STRATEGIES

    return STRATEGIES.entry(spec.strategy).uses_scores


def _budget_text(v: dict) -> str:
    """A select / learned variant's FA budget in words: "1/8 of the KV groups", "7:1 (LA:FA) in query heads"..."""
    from fractions import Fraction

    unit = "KV groups" if v["unit"] == "kv_group" else "query heads"
    if v.get("fraction") is not None:
        return f"{Fraction(v['fraction']).limit_denominator(64)} of the {unit}"
    if v.get("ratio") is not None:
        return f"{v['ratio']} (LA:FA) in {unit}"
    return f"{v['k']} {unit}"


VARIANT_KINDS.register("select", VariantKind(_select, _uses_scores, "headscope.select by strategy and unit",
                                             describe=lambda v: f"{v['strategy']}, {_budget_text(v)}"))
VARIANT_KINDS.register("layerwise", VariantKind(_layerwise, doc="whole FA layers (hybrid.builders.layerwise_mask)",
                                                describe=lambda v: f"layer-wise {v['ratio']}"))
VARIANT_KINDS.register("token", VariantKind(_token, doc="sliding-window attention + GDN on every head",
                                            describe=lambda v: f"token-level, window {v['window']}"))
VARIANT_KINDS.register("teacher", VariantKind(_teacher, doc="the teacher itself, evaluated only"))
VARIANT_KINDS.register("tuned_teacher", VariantKind(
    _tuned_teacher, doc="the teacher trained like the hybrids (every head FA with its RoPE, no merge norm: the "
                        "teacher's function; the stages that train the whole model)", new_parameters=False,
    describe=lambda v: "teacher, trained like the hybrids"))
VARIANT_KINDS.register("learned", VariantKind(
    _learned, doc="a learned per-head FA/GDN gate (research.studies.selector), top gates at the budget",
    needs_data=lambda spec: True, describe=lambda v: f"learned gates ({v['strategy']} top), {_budget_text(v)}"))


def mask_shares(teacher, mask, options: dict[str, Any], train_length: int) -> dict[str, Any]:
    """FA query-head share, KV cache share at ``train_length`` tokens (``hybrid.cache_nbytes``: the FA branch's
    keys/values, or the sliding window's), GDN state bytes, and the layers holding an FA head."""
    from headscope.mask import model_shape
    from hybrid.cache import cache_nbytes, teacher_cache_nbytes
    from hybrid.config import HybridOptions
    from hybrid.convert import hybrid_config

    s = model_shape(teacher)
    L, H = s["num_hidden_layers"], s["num_attention_heads"]
    if mask is None:
        return {"fa_query_share": 1.0, "kv_share": 1.0, "n_fa_heads": L * H, "layers_with_fa": L,
                "gdn_state_bytes": 0, "kv_bytes": teacher_cache_nbytes(teacher, train_length)}
    opts = HybridOptions.from_dict({**options, "allow_degenerate": True})
    fa = [[] for _ in range(L)] if opts.granularity == "token" else [list(mask.fa_in_layer(l)) for l in range(L)]
    cfg = hybrid_config(teacher, fa, opts)
    c = cache_nbytes(cfg, train_length)
    n_fa = sum(len(x) for x in fa)
    return {"fa_query_share": n_fa / (L * H), "kv_share": c["fa_kv"] / c["teacher"], "n_fa_heads": n_fa,
            "layers_with_fa": sum(1 for x in fa if x), "gdn_state_bytes": c["gdn_state"], "kv_bytes": c["fa_kv"],
            "fa_heads": [h.to_list() for h in mask.fa_heads]}


def build_variant(spec: VariantSpec, teacher, *, scores=None, seed: int = 0, base_options: dict | None = None,
                  train_length: int = 2048, context: BuildContext | None = None) -> BuiltVariant:
    """The variant's mask (None for the teacher), its hybrid options (the study's ``base_options``, then the
    kind's, then the spec's own) and its shares; raises ``InfeasibleVariant`` when the budget cannot be met.
    ``context``: what a kind that trains needs (``spec.needs_data``; kind "learned")."""
    if context is not None:  # the kind sees the hybrid options the variant trains with
        context = replace(context, hybrid={"seed": seed, **(base_options or {}), **spec.hybrid})
    mask, kind_options = VARIANT_KINDS.entry(spec.kind, who="variant kind").build(spec, teacher, scores, seed,
                                                                                   context)
    options = {"seed": seed, **(base_options or {}), **kind_options, **spec.hybrid}  # seed: the new parameters' init
    info = mask_shares(teacher, mask, options, train_length)
    if mask is not None:
        info["ratio"] = mask.ratio
        info["settings"] = json.loads(json.dumps(mask.settings, default=str))
    return BuiltVariant(mask, options if spec.trains else {}, info)


# ---- the teacher's scores (NIAH + reasoning receiver scores, fused) -----------------------------------------

DEFAULT_SENDER_ROUNDS = 3  # rounds of iterated path patching, as `headscope run --sender-rounds`
REASONING_SOLVED_MIN = 0.9  # as the head report (research/report_heads.py): reasoning scores enter the fusion
# only when the teacher answers >= 90% of the clean reasoning prompts; on a task the model fails a receiver score
# ranks noise (SmolLM2-135M: 62-88% per family, docs/smollm2_135m_heads.md -> its mask comes from NIAH alone)


def selection_scores(teacher, tokenizer, *, n_samples: int = 16, context_length: int = 1024,
                     haystack: str = "heldout", device=None, path: str | Path | None = None, progress: bool = True,
                     min_reasoning_accuracy: float = REASONING_SOLVED_MIN, sender_rounds: int = DEFAULT_SENDER_ROUNDS):
    """The fused NIAH + reasoning scores of ``teacher``: per task the receiver scores (``headscope.score``) combined
    with the sender scores of iterated path patching (``headscope.senders.iterated_path_patching``, up to
    ``sender_rounds`` rounds; 0 = receiver scores alone), then ``fuse`` across tasks: the whole method, as
    ``headscope run`` does it.

    Reasoning is fused only when the teacher's clean accuracy on its prompts is >= ``min_reasoning_accuracy``
    (checked before any patching); otherwise the scores are NIAH's alone, with a warning, and
    ``settings["reasoning_left_out"]`` says why (None when reasoning was fused).

    With ``path``: loaded from there when it holds scores of this teacher with these settings, else computed and
    written there (so a study's variants, and a resumed study, score the teacher once)."""
    import warnings

    from headscope.api import score
    from headscope.fusion import fuse
    from headscope.io import write_text
    from headscope.mask import config_fingerprint
    from headscope.patching.engine import CleanFailureError
    from headscope.results import HeadScores

    key = {"teacher": config_fingerprint(teacher), "n_samples": n_samples, "context_length": context_length,
           "haystack": haystack, "tasks": ["niah", "reasoning"], "min_reasoning_accuracy": min_reasoning_accuracy,
           "sender_rounds": sender_rounds}
    if path is not None and Path(path).exists():
        cached = HeadScores.from_json(path)
        if _same_key(cached.settings.get("study_key"), key, teacher):
            return cached
    tasks = {"niah": score(teacher, "niah", tokenizer=tokenizer, n_samples=n_samples, device=device,
                           context_length=context_length, haystack=haystack, progress=progress)}
    left_out = None
    try:
        tasks["reasoning"] = score(teacher, "reasoning", tokenizer=tokenizer, n_samples=n_samples, device=device,
                                   progress=progress, on_clean_failure="error",
                                   min_clean_accuracy=min_reasoning_accuracy)
    except CleanFailureError as err:  # the teacher does not solve the reasoning prompts: NIAH alone
        left_out = str(err).split(". Fix:")[0]
        warnings.warn(f"selection_scores: reasoning left out of the fusion, NIAH alone ({left_out})", stacklevel=2)
    if sender_rounds:
        from headscope.senders import iterated_path_patching

        task_kwargs = {"niah": {"context_length": context_length, "haystack": haystack}, "reasoning": {}}
        for name in list(tasks):
            res = iterated_path_patching(teacher, name, tokenizer=tokenizer, receiver_scores=tasks[name],
                                         max_rounds=sender_rounds, n_samples=n_samples, device=device,
                                         progress=progress, **task_kwargs[name])
            tasks[name] = res.combined
    fused = fuse(tasks)
    fused.settings["study_key"] = key
    fused.settings["reasoning_left_out"] = left_out
    if path is not None:
        write_text(path, fused.to_json())
    return fused


def make_mask(teacher, tokenizer, fraction: float, n_samples: int, context_length: int, device,
              scores_path: str | Path | None = None, sender_rounds: int = DEFAULT_SENDER_ROUNDS):
    """Score NIAH + reasoning (receiver + sender scores), fuse, keep the top ``fraction`` of KV groups (all their
    query heads) as FA."""
    from headscope.selection import select

    scores = selection_scores(teacher, tokenizer, n_samples=n_samples, context_length=context_length, device=device,
                              path=scores_path, sender_rounds=sender_rounds)
    return select(scores, fraction=fraction, unit="kv_group", model=teacher, strategy="global")
