"""Choose the full-attention (FA) heads: causal selection and the paper's baselines, as a HeadMask.

    mask = select(fused, ratio="7:1", strategy="global_per_layer_min", model=model)
    base = select(fused, ratio="7:1", strategy="random_per_layer", seed=0)   # a baseline, by name
    kv = select(fused, fraction=1 / 8, unit="kv_group", model=model)        # 1/8 of the KV cache
    print(mask.summary())

Budgets are always the TOTAL number K of units kept, given as exactly one of ``k`` (a count),
``fraction`` (K = round(fraction * L * G), at least 1) or ``ratio`` ("LA:FA", e.g. "7:1" ->
K = round(L * G / 8)). A unit is a query head (``unit="head"``, the paper's count, G = H heads per
layer) or a whole key/value group (``unit="kv_group"``, G = n_kv_heads per layer: a group is ranked by
``kv_group_scores`` and every query head of a chosen group becomes FA, so "1/8" keeps 1/8 of the
teacher's KV cache).

Strategies (the registry ``STRATEGIES``; add one with ``register_strategy(name, fn)``):
- "global_per_layer_min" (``DEFAULT_STRATEGY``: the method's, the default of ``select`` and of the command
  line): global top-K, then every layer without an FA unit gets that layer's best
  unit by the UNWEIGHTED receiver score (then the unweighted sender score, then the ranking score)
  and, to keep K, the lowest-ranked units of layers that hold more than one are dropped (K >= L).
- "global": the K best units of the whole model (may leave layers without an FA unit; any K).
- "per_layer": K // L best units in every layer; the K mod L leftovers go to the layers whose
  next-best unit ranks highest.
- baselines (they ignore the scores): "random_global", "random_per_layer", "fixed_ratio" (the
  same first round(K / L) units in every layer), "layerwise" (round(K / G) whole layers, evenly
  spaced).
The ranking is the score (e.g. a fused map), ties broken by the unweighted receiver then sender
maps (``fusion.signal_maps``), then by (layer, unit) order or randomly with ``seed``.
"""
from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from headscope.heads import Head
from headscope.mask import HeadMask, MaskError, model_shape
from headscope.registry import Registry
from headscope.results import HeadScores, require_finite

__all__ = ["select", "random_per_layer", "random_global", "fixed_ratio", "layerwise", "kv_group_scores",
           "parse_ratio", "budget", "register_strategy", "Strategy", "SelectionInput", "STRATEGIES", "UNITS",
           "DEFAULT_STRATEGY"]

UNITS = ("head", "kv_group")
# the method's selection (docs/method.md): global top-K with at least one FA unit per layer; select() and the
# command line's --strategy default to it
DEFAULT_STRATEGY = "global_per_layer_min"


def parse_ratio(ratio: str | float | int) -> float:
    """'7:1' -> 7.0 (linear-attention heads per full-attention head); a number is taken as LA/FA."""
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
        r = float(ratio)
    else:
        parts = str(ratio).split(":")
        try:
            la, fa = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"ratio={ratio!r} is not 'LA:FA' like '7:1' or '3:1'") from None
        if fa <= 0:
            raise ValueError(f"ratio={ratio!r}: the FA part must be > 0")
        r = la / fa
    if not r >= 0 or r == float("inf"):
        raise ValueError(f"ratio={ratio!r} must be a finite LA:FA ratio >= 0, like '7:1'")
    return r


def budget(n_total: int, k: int | None = None, fraction: float | None = None,
           ratio: str | float | None = None) -> int:
    """The number of FA units from exactly one of k / fraction / ratio (see the module docstring)."""
    given = [name for name, v in (("k", k), ("fraction", fraction), ("ratio", ratio)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of k, fraction, ratio (got {given or 'none'})")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"k must be an int, got {k!r}")
        out = k
    elif fraction is not None:
        if isinstance(fraction, bool) or not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"fraction={fraction} must be in (0, 1]")
        out = max(1, round(float(fraction) * n_total))
    else:
        out = max(1, round(n_total / (parse_ratio(ratio) + 1.0)))
    if not 1 <= out <= n_total:
        raise ValueError(f"k={out} is outside 1..{n_total} (the number of units to choose from)")
    return out


# ----------------------------------------------------------------------------- strategies

@dataclass(frozen=True)
class SelectionInput:
    """What a strategy sees: a grid of ``n_layers`` x ``n_units`` units (query heads, or KV groups with
    ``unit="kv_group"``) and the budget ``k``. Flat unit index i is (layer i // n_units, unit i % n_units).

    ``score``: the ranking map ``[L, G]`` (None when a baseline is called without scores);
    ``receiver`` / ``sender``: the unweighted maps ``[L, G]`` used to break ties (None when unknown).
    A strategy may put what it decided (e.g. the layers it kept) into ``info``: it goes to the mask's
    settings."""

    n_layers: int
    n_units: int
    k: int
    score: torch.Tensor | None = None  # [L, G]
    receiver: torch.Tensor | None = None  # [L, G]
    sender: torch.Tensor | None = None  # [L, G]
    seed: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    unit: str = "head"

    def _need_scores(self) -> torch.Tensor:
        if self.score is None:
            raise ValueError("this strategy ranks heads by score: pass scores to select()")
        return self.score

    def _keys(self, i: int) -> tuple[float, float]:
        G = self.n_units
        r = 0.0 if self.receiver is None else float(self.receiver[i // G, i % G])
        s = 0.0 if self.sender is None else float(self.sender[i // G, i % G])
        return r, s

    def order(self) -> list[int]:
        """Flat unit indices, best first: by score, then unweighted receiver, then sender; the last ties
        by (layer, unit), or randomly (reproducibly) when a seed is given."""
        flat = self._need_scores().flatten().tolist()
        tie = list(range(len(flat)))
        if self.seed is not None:
            random.Random(self.seed).shuffle(tie)
        return sorted(range(len(flat)), key=lambda i: (-flat[i], *(-x for x in self._keys(i)), tie[i]))

    def layer_best(self, layer: int, rank: dict[int, int]) -> int:
        """The best unit of ``layer``: by the unweighted receiver map, then the sender map, then ``rank``
        (position in ``order()``)."""
        units = range(layer * self.n_units, (layer + 1) * self.n_units)
        return min(units, key=lambda i: (*(-x for x in self._keys(i)), rank[i]))

    def rng(self) -> random.Random:
        return random.Random(0 if self.seed is None else self.seed)


@dataclass(frozen=True)
class Strategy:
    """A selection strategy: ``fn(SelectionInput) -> flat unit indices``; ``uses_scores`` False for
    baselines (no no-signal warning); ``options`` the extra keyword arguments ``select`` passes on."""

    fn: Callable[[SelectionInput], list[int]]
    uses_scores: bool = True
    options: tuple[str, ...] = ()
    doc: str = ""


STRATEGIES: Registry[Strategy] = Registry("selection strategy", owner="headscope.selection.STRATEGIES")


def register_strategy(name: str, fn: Callable[[SelectionInput], list[int]], *, uses_scores: bool = True,
                      options: tuple[str, ...] = (), doc: str = "", overwrite: bool = False) -> Strategy:
    """Add a strategy usable as ``select(..., strategy=name)`` (and by the CLI's --strategy); a taken name needs
    ``overwrite=True``."""
    entry = Strategy(fn=fn, uses_scores=uses_scores, options=tuple(options), doc=doc)
    return STRATEGIES.register(name, entry, overwrite=overwrite)


def _global(inp: SelectionInput) -> list[int]:
    return inp.order()[:inp.k]


def _global_per_layer_min(inp: SelectionInput) -> list[int]:
    L, G, K = inp.n_layers, inp.n_units, inp.k
    if K < L:
        what = "KV groups" if inp.unit == "kv_group" else "heads"
        raise ValueError(f"select: strategy 'global_per_layer_min' needs k >= n_layers ({L}) to put an FA unit "
                         f"in every layer, got k={K} {what}; raise k or use strategy='global'")
    order = inp.order()
    rank = {i: r for r, i in enumerate(order)}
    chosen = order[:K]
    filled = []
    for layer in range(L):
        if not any(i // G == layer for i in chosen):
            best = inp.layer_best(layer, rank)
            chosen.append(best)
            filled.append(best)
    while len(chosen) > K:  # drop the worst-ranked unit among layers holding more than one
        counts = [sum(1 for i in chosen if i // G == l) for l in range(L)]
        worst = max((i for i in chosen if counts[i // G] > 1), key=rank.__getitem__)
        chosen.remove(worst)
    inp.info["filled_layers"] = [i // G for i in filled]
    return chosen


def _per_layer(inp: SelectionInput) -> list[int]:
    L, G, K = inp.n_layers, inp.n_units, inp.k
    base, extra = divmod(K, L)
    rank = {i: r for r, i in enumerate(inp.order())}
    per_layer = [sorted(range(l * G, (l + 1) * G), key=rank.__getitem__) for l in range(L)]
    chosen = [i for l in range(L) for i in per_layer[l][:base]]
    if extra:
        nxt = sorted((per_layer[l][base] for l in range(L)), key=rank.__getitem__)
        chosen += nxt[:extra]
    return chosen


def _random_global(inp: SelectionInput) -> list[int]:
    return inp.rng().sample(range(inp.n_layers * inp.n_units), inp.k)


def _random_per_layer(inp: SelectionInput) -> list[int]:
    L, G = inp.n_layers, inp.n_units
    rng = inp.rng()
    base, extra = divmod(inp.k, L)
    bonus = set(rng.sample(range(L), extra))
    return [l * G + u for l in range(L) for u in rng.sample(range(G), base + (l in bonus))]


def _fixed_ratio(inp: SelectionInput) -> list[int]:
    L, G = inp.n_layers, inp.n_units
    units = inp.options.get("heads")
    if units is None:
        units = list(range(min(G, max(1, round(inp.k / L)))))
    units = list(units)
    bad = [u for u in units if isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < G]
    if bad or len(set(units)) != len(units) or not units:
        raise ValueError(f"fixed_ratio: heads={units} must be distinct integer indices in 0..{G - 1}")
    inp.info["heads"] = units
    return [l * G + u for l in range(L) for u in units]


def _layerwise(inp: SelectionInput) -> list[int]:
    L, G = inp.n_layers, inp.n_units
    layers = inp.options.get("layers")
    if layers is None:
        m = min(L, max(1, round(inp.k / G)))
        layers = sorted({round((i + 1) * L / m) - 1 for i in range(m)})
    inp.info["layers"] = list(layers)
    return [l * G + u for l in layers for u in range(G)]


register_strategy("global", _global, doc="the K best units of the model")
register_strategy("global_per_layer_min", _global_per_layer_min,
                  doc="global top-K with at least one FA unit per layer (a layer's best by unweighted receiver)")
register_strategy("per_layer", _per_layer, doc="K // L best units per layer")
register_strategy("random_global", _random_global, uses_scores=False, doc="K random units anywhere")
register_strategy("random_per_layer", _random_per_layer, uses_scores=False, doc="K // L random units per layer")
register_strategy("fixed_ratio", _fixed_ratio, uses_scores=False, options=("heads",),
                  doc="the same first round(K / L) units (or heads=[...]) in every layer")
register_strategy("layerwise", _layerwise, uses_scores=False, options=("layers",),
                  doc="round(K / G) whole layers, evenly spaced (or layers=[...])")


# ----------------------------------------------------------------------------- inputs

def _shape(obj: Any) -> tuple[int, int, int | None, Any]:
    """(L, H, n_kv_heads, model_or_None) from HeadScores, a [L, H] tensor, (L, H[, KV]), a model or a config."""
    if isinstance(obj, HeadScores):
        return obj.n_layers, obj.n_heads, obj.n_kv_heads, None
    if isinstance(obj, torch.Tensor):
        if obj.dim() != 2:
            raise ValueError(f"expected a [layers, heads] tensor, got shape {tuple(obj.shape)}")
        return obj.shape[0], obj.shape[1], None, None
    if isinstance(obj, (tuple, list)) and len(obj) in (2, 3) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in obj):
        return int(obj[0]), int(obj[1]), (int(obj[2]) if len(obj) == 3 else None), None
    try:
        s = model_shape(obj)
    except (MaskError, AttributeError, TypeError):
        raise TypeError(f"cannot read a (layers, heads) shape from {type(obj).__name__}; pass (L, H), "
                        "(L, H, n_kv_heads), a [L, H] tensor, HeadScores or a model/config") from None
    return s["num_hidden_layers"], s["num_attention_heads"], s["num_key_value_heads"], obj


def _score_maps(scores: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(ranking map [L, H], every unweighted map by name incl. "score") from HeadScores or a tensor."""
    if isinstance(scores, HeadScores):
        from headscope.fusion import signal_maps

        require_finite(scores.per_sample_raw, "select", f"scores of {scores.task!r} ({scores.kind})")
        maps = signal_maps(scores)
        for name, m in maps.items():
            require_finite(m, "select", f"the {name!r} map of {scores.task!r}")
        return maps["score"].double(), maps
    if isinstance(scores, bool) or scores is None:
        raise TypeError(f"select: scores must be HeadScores or a [layers, heads] tensor, got {scores!r}")
    t = torch.as_tensor(scores, dtype=torch.float64)
    if t.dim() != 2:
        raise ValueError(f"select: scores must be HeadScores or a [layers, heads] tensor, got shape {tuple(t.shape)}")
    require_finite(t, "select", "scores")
    return t, {"score": t}


def _score_tensor(scores: Any) -> torch.Tensor:
    return _score_maps(scores)[0]


def _n_kv(scores: Any, model: Any, n_kv_heads: int | None, H: int) -> int | None:
    found = {}
    if n_kv_heads is not None:
        if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int):
            raise TypeError(f"select: n_kv_heads must be an int, got {n_kv_heads!r}")
        found["n_kv_heads="] = n_kv_heads
    if model is not None:
        found["the model"] = model_shape(model)["num_key_value_heads"]
    kv = getattr(scores, "n_kv_heads", None)
    if kv is not None:
        found["the scores"] = kv
    if len(set(found.values())) > 1:
        raise ValueError(f"select: the number of KV heads disagrees: {found}; score and select on one model")
    kv = next(iter(found.values()), None)
    if kv is not None and (kv < 1 or H % kv):
        raise ValueError(f"select: n_kv_heads={kv} must divide the {H} query heads per layer")
    return kv


def _make_mask(heads: list[Head], L: int, H: int, kv: int | None, model: Any, scores: torch.Tensor | None,
               settings: dict) -> HeadMask:
    rows = None if scores is None else scores.tolist()
    if model is not None:
        shape = model_shape(model)
        if (shape["num_hidden_layers"], shape["num_attention_heads"]) != (L, H):
            raise MaskError(f"scores are {L} layers x {H} heads but the model has {shape['num_hidden_layers']} x "
                            f"{shape['num_attention_heads']}: score this model")
        return HeadMask.for_model(model, heads, scores=rows, settings=settings)
    return HeadMask(n_layers=L, n_heads=H, n_kv_heads=kv, fa_heads=tuple(heads), scores=rows, settings=settings)


def _no_signal(heads: list[Head], maps: dict[str, torch.Tensor]) -> list[Head]:
    """Selected heads whose score is <= 0 in every map (they carry no measured causal effect)."""
    return [h for h in heads if all(float(m[h.layer, h.head]) <= 0.0 for m in maps.values())]


# ----------------------------------------------------------------------------- select

def _run(strategy: str, *, L: int, H: int, kv: int | None, model: Any, k: Any, fraction: Any, ratio: Any,
         seed: int | None, unit: str, kv_reduce: str, options: dict, s: torch.Tensor | None = None,
         maps: dict[str, torch.Tensor] | None = None, scores: Any = None) -> HeadMask:
    entry = STRATEGIES.entry(strategy, who="select: strategy")
    unknown = sorted(set(options) - set(entry.options))
    if unknown:
        raise TypeError(f"select: strategy {strategy!r} takes no option(s) {unknown}"
                        + (f"; it takes {list(entry.options)}" if entry.options else ""))
    if unit not in UNITS:
        raise ValueError(f"select: unit={unit!r} is not one of {UNITS} (count the budget in query heads, as the "
                         "paper does, or in whole KV groups)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"select: seed must be an int or None, got {seed!r}")
    if kv_reduce not in ("max", "mean", "sum"):
        raise ValueError(f"select: kv_reduce={kv_reduce!r} is not one of ('max', 'mean', 'sum')")
    if not entry.uses_scores and seed is None:
        seed = 0  # the random baselines are always seeded (and the seed recorded)
    maps = maps or {}
    if unit == "kv_group":
        if kv is None:
            raise ValueError("select: unit='kv_group' needs the number of KV heads: pass model=, n_kv_heads= or "
                             "scores that record n_kv_heads")
        G = kv
        group = lambda m: None if m is None else kv_group_scores(m, kv, kv_reduce)  # noqa: E731  [L, H] -> [L, G]
    else:
        G = H
        group = lambda m: m  # noqa: E731
    K = budget(L * G, k, fraction, ratio)
    inp = SelectionInput(n_layers=L, n_units=G, k=K, score=group(s), receiver=group(maps.get("receiver")),
                         sender=group(maps.get("sender")), seed=seed, options=dict(options), unit=unit)
    if entry.uses_scores and s is None:
        raise ValueError(f"select: strategy {strategy!r} ranks heads by score; pass scores")
    units = [int(i) for i in entry.fn(inp)]
    if len(set(units)) != len(units) or any(not 0 <= i < L * G for i in units):
        raise RuntimeError(f"strategy {strategy!r} returned invalid units {units}: they must be distinct flat "
                           f"indices in 0..{L * G - 1}")
    per = H // G
    heads = sorted(Head(i // G, (i % G) * per + j) for i in units for j in range(per))
    settings: dict[str, Any] = {"strategy": strategy, "unit": unit, "k": len(units), "n_fa_heads": len(heads),
                                "fraction": fraction, "ratio": ratio, "seed": seed}
    if len(units) != K:
        settings["k_budget"] = K
    if unit == "kv_group":
        settings["kv_reduce"] = kv_reduce
    if options:
        settings["options"] = dict(options)
    settings.update(inp.info)
    if scores is not None:
        settings["scores_task"] = getattr(scores, "task", None)
        settings["scores_kind"] = getattr(scores, "kind", None)
        if isinstance(scores, HeadScores) and scores.kind == "fused":
            settings["fusion"] = {key: scores.settings.get(key) for key in (
                "tasks", "weights", "weights_from", "classes", "class_weights", "stability", "stability_formula",
                "threshold", "normalize")}
    if maps:
        empty = _no_signal(heads, maps)
        settings.update(n_no_signal=len(empty), no_signal_heads=[h.to_list() for h in empty],
                        signal_maps=sorted(maps))
        if empty and entry.uses_scores:
            shown = ", ".join(str(h) for h in empty[:12]) + (" ..." if len(empty) > 12 else "")
            warnings.warn(f"select: {len(empty)} of {len(heads)} FA heads carry no causal signal (score 0 in every "
                          f"map: {', '.join(sorted(maps))}): {shown}. They only fill the budget or a layer's "
                          "minimum; score more samples or tasks, or choose a smaller budget", UserWarning,
                          stacklevel=3)
    return _make_mask(heads, L, H, kv, model, s, settings)


def select(scores: HeadScores | torch.Tensor, *, k: int | None = None, fraction: float | None = None,
           ratio: str | float | None = None, strategy: str = DEFAULT_STRATEGY, seed: int | None = None,
           model: Any = None, unit: str = "head", n_kv_heads: int | None = None, kv_reduce: str = "max",
           **options: Any) -> HeadMask:
    """Keep the best units as FA; see the module docstring for budgets, units and strategies.

    ``scores``: HeadScores (its ``.scores``, e.g. a fused map; its unweighted receiver / sender maps
    break ties and fill per-layer minimums) or a finite ``[L, H]`` tensor. ``strategy``: the method's
    "global_per_layer_min" by default (``DEFAULT_STRATEGY``, as ``headscope run`` / ``select``: it needs
    K >= L, else use "global"), or any name in ``STRATEGIES``, the baselines included (``seed`` seeds the
    random ones, default 0; for the others it breaks exact ties randomly). ``unit``: "head" (default) or "kv_group" (groups ranked by
    ``kv_group_scores(..., reduce=kv_reduce)``). ``model`` (or its config) makes the mask carry the
    model's shape, KV heads and config fingerprint; ``n_kv_heads`` gives the KV heads without a model.
    ``options``: a strategy's own keywords (fixed_ratio: ``heads=[...]``; layerwise: ``layers=[...]``).

    The mask's settings record the strategy, unit, K, the fusion used, and ``n_no_signal`` /
    ``no_signal_heads``: selected heads whose score is 0 in every available map; a warning names them.
    """
    s, maps = _score_maps(scores)  # [L, H]
    L, H = s.shape
    kv = _n_kv(scores, model, n_kv_heads, H)
    return _run(strategy, L=L, H=H, kv=kv, model=model, k=k, fraction=fraction, ratio=ratio, seed=seed, unit=unit,
                kv_reduce=kv_reduce, options=options, s=s, maps=maps, scores=scores)


# ----------------------------------------------------------------------------- baselines

def _baseline(strategy: str, shape: Any, *, k: Any = None, fraction: Any = None, ratio: Any = None,
              seed: int | None = None, unit: str = "head", options: dict | None = None) -> HeadMask:
    if isinstance(shape, (HeadScores, torch.Tensor)):
        return select(shape, k=k, fraction=fraction, ratio=ratio, strategy=strategy, seed=seed, unit=unit,
                      **(options or {}))
    L, H, kv, model = _shape(shape)
    return _run(strategy, L=L, H=H, kv=kv, model=model, k=k, fraction=fraction, ratio=ratio, seed=seed, unit=unit,
                kv_reduce="max", options=options or {})


def random_global(shape: Any, k: int | None = None, seed: int = 0, *, fraction: float | None = None,
                  ratio: str | float | None = None, unit: str = "head") -> HeadMask:
    """K units drawn uniformly from the whole model (may leave layers with no FA head).

    ``shape``: (L, H[, n_kv_heads]), a model or config, or scores (then recorded in the mask)."""
    return _baseline("random_global", shape, k=k, fraction=fraction, ratio=ratio, seed=seed, unit=unit)


def random_per_layer(shape: Any, k: int | None = None, seed: int = 0, *, fraction: float | None = None,
                     ratio: str | float | None = None, unit: str = "head") -> HeadMask:
    """K // L random units in every layer; the K mod L leftovers go to randomly chosen layers."""
    return _baseline("random_per_layer", shape, k=k, fraction=fraction, ratio=ratio, seed=seed, unit=unit)


def fixed_ratio(shape: Any, ratio: str | float = "7:1", heads: list[int] | None = None,
                unit: str = "head") -> HeadMask:
    """The same unit indices in every layer: the first max(1, round(G / (r + 1))) (or ``heads``)."""
    L, H, kv, _ = _shape(shape)
    G = kv if unit == "kv_group" and kv else H
    if heads is None:
        heads = list(range(max(1, round(G / (parse_ratio(ratio) + 1.0)))))
    return _baseline("fixed_ratio", shape, ratio=ratio, unit=unit, options={"heads": list(heads)})


def layerwise(shape: Any, ratio: str | float = "3:1") -> HeadMask:
    """Whole layers FA, evenly spaced, as in a layer-wise hybrid.

    m = round(L / (r + 1)) layers (at least 1): layers round((i + 1) * L / m) - 1 for i < m, e.g.
    "3:1" on 28 layers keeps layers 3, 7, ..., 27 (every 4th layer, the last one included).
    """
    L, _, _, _ = _shape(shape)
    m = min(L, max(1, round(L / (parse_ratio(ratio) + 1.0))))
    layers = sorted({round((i + 1) * L / m) - 1 for i in range(m)})
    return _baseline("layerwise", shape, ratio=ratio, options={"layers": layers})


# ----------------------------------------------------------------------------- GQA

def kv_group_scores(scores: HeadScores | torch.Tensor, n_kv_heads: int | None = None,
                    reduce: str = "max") -> torch.Tensor:
    """Scores per key/value head, ``[L, K]``: ``reduce`` ("max" | "mean" | "sum") over the query heads
    that share it. ``n_kv_heads`` defaults to the HeadScores' own. ``select(..., unit="kv_group")``
    ranks whole groups by it."""
    if reduce not in ("max", "mean", "sum"):
        raise ValueError(f"kv_group_scores: reduce={reduce!r} is not one of ('max', 'mean', 'sum')")
    if n_kv_heads is None:
        n_kv_heads = getattr(scores, "n_kv_heads", None)
        if n_kv_heads is None:
            raise ValueError("kv_group_scores: pass n_kv_heads (these scores do not record it)")
    s = _score_tensor(scores)  # [L, H]
    L, H = s.shape
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads < 1 or H % n_kv_heads:
        raise ValueError(f"kv_group_scores: n_kv_heads={n_kv_heads!r} must be an int that divides n_heads={H}")
    g = s.view(L, n_kv_heads, H // n_kv_heads)  # [L, K, H/K]
    return g.amax(-1) if reduce == "max" else g.mean(-1) if reduce == "mean" else g.sum(-1)  # [L, K]
