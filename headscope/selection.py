"""Choose the full-attention (FA) heads: causal selection and the paper's baselines, as a HeadMask.

    mask = select(fused, ratio="7:1", strategy="global_per_layer_min", model=model)
    base = random_per_layer(model, k=len(mask), seed=0)

Budgets are always the TOTAL number of FA heads K, given as exactly one of ``k`` (a count),
``fraction`` (K = round(fraction * L * H), at least 1) or ``ratio`` ("LA:FA", e.g. "7:1" ->
K = round(L * H / 8)). Strategies:
- "global": the K best heads of the whole model.
- "global_per_layer_min": global top-K, then every layer without an FA head gets its best head and,
  to keep K, the lowest-scored heads of layers that have more than one are dropped (needs K >= L).
- "per_layer": K // L best heads in every layer; the K mod L leftover heads go to the layers whose
  next-best head scores highest.
"""
from __future__ import annotations

import random
from typing import Any

import torch

from headscope.heads import Head
from headscope.mask import HeadMask, MaskError, model_shape
from headscope.results import HeadScores

__all__ = ["select", "random_per_layer", "random_global", "fixed_ratio", "layerwise", "kv_group_scores",
           "parse_ratio", "budget", "STRATEGIES"]

STRATEGIES = ("global", "global_per_layer_min", "per_layer")


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
    """The number of FA heads from exactly one of k / fraction / ratio (see the module docstring)."""
    given = [name for name, v in (("k", k), ("fraction", fraction), ("ratio", ratio)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of k, fraction, ratio (got {given or 'none'})")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"k must be an int, got {k!r}")
        out = k
    elif fraction is not None:
        if not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"fraction={fraction} must be in (0, 1]")
        out = max(1, round(float(fraction) * n_total))
    else:
        out = max(1, round(n_total / (parse_ratio(ratio) + 1.0)))
    if not 1 <= out <= n_total:
        raise ValueError(f"k={out} heads is outside 1..{n_total} (the model has {n_total} heads)")
    return out


def _shape(obj: Any) -> tuple[int, int, int | None, Any]:
    """(L, H, n_kv_heads, model_or_None) from HeadScores, a [L, H] tensor, (L, H), a model or a config."""
    if isinstance(obj, HeadScores):
        return obj.n_layers, obj.n_heads, obj.n_kv_heads, None
    if isinstance(obj, torch.Tensor):
        if obj.dim() != 2:
            raise ValueError(f"expected a [layers, heads] tensor, got shape {tuple(obj.shape)}")
        return obj.shape[0], obj.shape[1], None, None
    if isinstance(obj, (tuple, list)) and len(obj) in (2, 3) and all(isinstance(x, int) for x in obj):
        return int(obj[0]), int(obj[1]), (int(obj[2]) if len(obj) == 3 else None), None
    try:
        s = model_shape(obj)
    except (MaskError, AttributeError, TypeError):
        raise TypeError(f"cannot read a (layers, heads) shape from {type(obj).__name__}; pass (L, H), "
                        "a [L, H] tensor, HeadScores or a model/config") from None
    return s["num_hidden_layers"], s["num_attention_heads"], s["num_key_value_heads"], obj


def _make_mask(heads: list[Head], L: int, H: int, kv: int | None, model: Any, scores: torch.Tensor | None,
               settings: dict) -> HeadMask:
    rows = None if scores is None else scores.tolist()
    if model is not None:
        shape = model_shape(model)
        if (shape["num_hidden_layers"], shape["num_attention_heads"]) != (L, H):
            raise MaskError(f"scores are {L} layers x {H} heads but the model has {shape['num_hidden_layers']} x "
                            f"{shape['num_attention_heads']}: score this model")
        return HeadMask.for_model(model, heads, scores=rows, settings=settings)
    if kv is not None and H % kv:
        kv = None
    return HeadMask(n_layers=L, n_heads=H, n_kv_heads=kv, fa_heads=tuple(heads), scores=rows, settings=settings)


def _score_tensor(scores: Any) -> torch.Tensor:
    if isinstance(scores, HeadScores):
        return scores.scores.double()  # [L, H]
    t = torch.as_tensor(scores, dtype=torch.float64)
    if t.dim() != 2:
        raise ValueError(f"select: scores must be HeadScores or a [layers, heads] tensor, got shape {tuple(t.shape)}")
    if torch.isnan(t).any():
        raise ValueError("select: scores contain NaN; fill or drop them before selecting")
    return t


def _order(s: torch.Tensor, seed: int | None) -> list[int]:
    """Flat head indices, best first. Ties go by (layer, head), or randomly when a seed is given."""
    flat = s.flatten().tolist()
    tie = list(range(len(flat)))
    if seed is not None:
        random.Random(seed).shuffle(tie)
    return sorted(range(len(flat)), key=lambda i: (-flat[i], tie[i]))


def select(scores: HeadScores | torch.Tensor, *, k: int | None = None, fraction: float | None = None,
           ratio: str | float | None = None, strategy: str = "global", seed: int | None = None,
           model: Any = None) -> HeadMask:
    """Keep the highest-scoring heads as FA; see the module docstring for budgets and strategies.

    ``scores``: HeadScores (its ``.scores``, e.g. a fused map) or a ``[L, H]`` tensor. ``model``
    (or its config) makes the mask carry the model's shape and config fingerprint.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"select: strategy={strategy!r} is not one of {STRATEGIES}")
    s = _score_tensor(scores)  # [L, H]
    L, H = s.shape
    K = budget(L * H, k, fraction, ratio)
    order = _order(s, seed)
    if strategy == "global":
        chosen = order[:K]
    elif strategy == "global_per_layer_min":
        if K < L:
            raise ValueError(f"select: strategy 'global_per_layer_min' needs k >= n_layers ({L}) to put an FA head "
                             f"in every layer, got k={K}; raise k or use strategy='global'")
        chosen = order[:K]
        rank = {i: r for r, i in enumerate(order)}
        for layer in range(L):
            if not any(i // H == layer for i in chosen):
                chosen.append(min(range(layer * H, (layer + 1) * H), key=rank.__getitem__))
        while len(chosen) > K:  # drop the worst head among layers holding more than one
            counts = [sum(1 for i in chosen if i // H == l) for l in range(L)]
            worst = max((i for i in chosen if counts[i // H] > 1), key=rank.__getitem__)
            chosen.remove(worst)
    else:
        base, extra = divmod(K, L)
        rank = {i: r for r, i in enumerate(order)}
        per_layer = [sorted(range(l * H, (l + 1) * H), key=rank.__getitem__) for l in range(L)]
        chosen = [i for l in range(L) for i in per_layer[l][:base]]
        if extra:
            nxt = sorted((per_layer[l][base] for l in range(L)), key=rank.__getitem__)
            chosen += nxt[:extra]
    heads = [Head(i // H, i % H) for i in chosen]
    settings = {"strategy": strategy, "k": K, "fraction": fraction, "ratio": ratio, "seed": seed,
                "scores_task": getattr(scores, "task", None), "scores_kind": getattr(scores, "kind", None)}
    if isinstance(scores, HeadScores) and scores.kind == "fused":
        settings["fusion"] = {key: scores.settings.get(key) for key in ("tasks", "weights", "stability",
                                                                       "threshold", "normalize")}
    kv = scores.n_kv_heads if isinstance(scores, HeadScores) else None
    return _make_mask(heads, L, H, kv, model, s, settings)


# ----------------------------------------------------------------------------- baselines

def random_global(shape: Any, k: int | None = None, seed: int = 0, *, fraction: float | None = None,
                  ratio: str | float | None = None) -> HeadMask:
    """K heads drawn uniformly from the whole model (may leave layers with no FA head)."""
    L, H, kv, model = _shape(shape)
    K = budget(L * H, k, fraction, ratio)
    chosen = random.Random(seed).sample(range(L * H), K)
    return _make_mask([Head(i // H, i % H) for i in chosen], L, H, kv, model, None,
                      {"strategy": "random_global", "k": K, "seed": seed})


def random_per_layer(shape: Any, k: int | None = None, seed: int = 0, *, fraction: float | None = None,
                     ratio: str | float | None = None) -> HeadMask:
    """K // L random heads in every layer; the K mod L leftovers go to randomly chosen layers."""
    L, H, kv, model = _shape(shape)
    K = budget(L * H, k, fraction, ratio)
    rng = random.Random(seed)
    base, extra = divmod(K, L)
    bonus = set(rng.sample(range(L), extra))
    heads = [Head(l, h) for l in range(L) for h in rng.sample(range(H), base + (l in bonus))]
    return _make_mask(heads, L, H, kv, model, None, {"strategy": "random_per_layer", "k": K, "seed": seed})


def fixed_ratio(shape: Any, ratio: str | float = "7:1", heads: list[int] | None = None) -> HeadMask:
    """The same head indices in every layer: the first round(H / (r + 1)) heads (or ``heads``)."""
    L, H, kv, model = _shape(shape)
    if heads is None:
        n = max(1, round(H / (parse_ratio(ratio) + 1.0)))
        heads = list(range(n))
    bad = [h for h in heads if not 0 <= h < H]
    if bad or len(set(heads)) != len(heads) or not heads:
        raise ValueError(f"fixed_ratio: heads={heads} must be distinct indices in 0..{H - 1}")
    out = [Head(l, h) for l in range(L) for h in heads]
    return _make_mask(out, L, H, kv, model, None,
                      {"strategy": "fixed_ratio", "k": len(out), "ratio": ratio, "heads": list(heads)})


def layerwise(shape: Any, ratio: str | float = "3:1") -> HeadMask:
    """Whole layers FA, evenly spaced, as in a layer-wise hybrid.

    m = round(L / (r + 1)) layers (at least 1): layers round((i + 1) * L / m) - 1 for i < m, e.g.
    "3:1" on 28 layers keeps layers 3, 7, ..., 27 (every 4th layer, the last one included).
    """
    L, H, kv, model = _shape(shape)
    m = min(L, max(1, round(L / (parse_ratio(ratio) + 1.0))))
    layers = sorted({round((i + 1) * L / m) - 1 for i in range(m)})
    out = [Head(l, h) for l in layers for h in range(H)]
    return _make_mask(out, L, H, kv, model, None,
                      {"strategy": "layerwise", "k": len(out), "ratio": ratio, "layers": layers})


# ----------------------------------------------------------------------------- GQA

def kv_group_scores(scores: HeadScores | torch.Tensor, n_kv_heads: int | None = None,
                    reduce: str = "max") -> torch.Tensor:
    """Scores per key/value head, ``[L, K]``: ``reduce`` ("max" | "mean" | "sum") over the query heads
    that share it. ``n_kv_heads`` defaults to the HeadScores' own."""
    if reduce not in ("max", "mean", "sum"):
        raise ValueError(f"kv_group_scores: reduce={reduce!r} is not one of ('max', 'mean', 'sum')")
    if n_kv_heads is None:
        n_kv_heads = getattr(scores, "n_kv_heads", None)
        if n_kv_heads is None:
            raise ValueError("kv_group_scores: pass n_kv_heads (these scores do not record it)")
    s = _score_tensor(scores)  # [L, H]
    L, H = s.shape
    if n_kv_heads < 1 or H % n_kv_heads:
        raise ValueError(f"kv_group_scores: n_kv_heads={n_kv_heads} must divide n_heads={H}")
    g = s.view(L, n_kv_heads, H // n_kv_heads)  # [L, K, H/K]
    return g.amax(-1) if reduce == "max" else g.mean(-1) if reduce == "mean" else g.sum(-1)  # [L, K]
