"""``HeadScores``: per-head causal scores of one task, with the per-sample scores kept."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from headscope.heads import Head
from headscope.io import write_text

__all__ = ["HeadScores", "require_finite"]


def require_finite(t: torch.Tensor, who: str, what: str = "scores", allow_nan: bool = False) -> None:
    """Raise ValueError when ``t`` (``[..., L, H]``) holds NaN (unless ``allow_nan``) or +-inf, naming
    how many and the first head."""
    t = torch.as_tensor(t)
    bad = torch.isinf(t) if allow_nan else ~torch.isfinite(t)
    if not bad.any():
        return
    idx = [int(i) for i in bad.nonzero()[0]]
    where = f"L{idx[-2]}H{idx[-1]}" if len(idx) >= 2 else str(idx)
    if len(idx) == 3:
        where += f" on sample {idx[0]}"
    n_nan, n_inf = int(torch.isnan(t).sum()) if not allow_nan else 0, int(torch.isinf(t).sum())
    kinds = " and ".join(x for x in (f"{n_nan} NaN" if n_nan else "", f"{n_inf} infinite" if n_inf else "") if x)
    raise ValueError(f"{who}: {what} contain {kinds} value(s) (first at {where}); a non-finite score has no "
                     "ranking: re-score (check the model's dtype and the clean/corrupt metric gap) or drop "
                     "those samples")


def _depth(x: Any) -> int:
    d = 0
    while isinstance(x, list) and x:
        d, x = d + 1, x[0]
    return d


def _check_numeric_grid(x: Any, key: str, where: str, ndim: int | None = None, n: int | None = None,
                        boolean: bool = False) -> None:
    """Raise ValueError naming the field and the first bad row when ``x`` (read from a scores JSON) is
    not a rectangular nested list of numbers (of ``ndim`` levels and ``n`` entries when given)."""
    expected = ("a list of true/false values, one per sample" if boolean else "a list of numbers, one per sample") \
        if ndim == 1 else "a [samples][layers][heads] list of numbers (or [layers][heads])"
    fix = "; re-save it with HeadScores.to_json or fix the file"

    def fail(msg: str) -> None:
        raise ValueError(f"scores file {where}: '{key}' {msg}; expected {expected}{fix}")

    if not isinstance(x, list) or not x:
        fail(f"is {type(x).__name__ if not isinstance(x, list) else 'an empty list'}")
    d = _depth(x)
    if ndim is not None and d != ndim:
        fail(f"has {d} level(s) of nesting")
    if ndim is None and d not in (2, 3):
        fail(f"has {d} level(s) of nesting")
    if n is not None and len(x) != n:
        fail(f"has {len(x)} entries but per_sample_raw has {n} sample(s)")

    def shape(v: Any) -> list[int]:
        out = []
        while isinstance(v, list):
            out.append(len(v))
            v = v[0] if v else None
        return out

    want = shape(x)

    def walk(v: Any, idx: tuple[int, ...]) -> None:
        level = len(idx)
        if level == d:
            ok = isinstance(v, bool) if boolean else (isinstance(v, (int, float)) and not isinstance(v, bool))
            if not ok and not (boolean and v in (0, 1)):
                fail(f"holds {v!r} ({type(v).__name__}) at {key}{''.join(f'[{i}]' for i in idx)}")
            return
        if not isinstance(v, list) or len(v) != want[level]:
            got = f"{len(v)} entries" if isinstance(v, list) else f"{v!r} ({type(v).__name__})"
            fail(f"row {key}{''.join(f'[{i}]' for i in idx)} has {got} where {want[level]} were expected "
                 f"(ragged rows: every row must have the same length, shape {tuple(want)})")
        for i, e in enumerate(v):
            walk(e, idx + (i,))

    walk(x, ())


@dataclass
class HeadScores:
    """Normalized causal scores of every head for one task.

    ``per_sample_raw[n, l, h]`` is the unclipped score of head (l, h) on sample n:
    (M_clean - M_patched) / (M_clean - M_corrupt). The paper's summaries state that the
    normalized score lies in [0, 1]; clipping each per-sample score to [0, 1] before averaging
    (``per_sample``) is this project's reading: ``scores`` is the mean of the clipped per-sample
    scores and ``raw`` the mean of the unclipped ones.
    """

    task: str
    per_sample_raw: torch.Tensor  # [N, L, H]
    kind: str = "receiver"  # "receiver" | "sender" | "combined" | "fused"
    n_kv_heads: int | None = None
    clean_metric: torch.Tensor | None = None  # [N]
    corrupt_metric: torch.Tensor | None = None  # [N]
    clean_correct: torch.Tensor | None = None  # [N] bool, greedy answer exact-match on the clean prompt
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = torch.as_tensor(self.per_sample_raw, dtype=torch.float64)
        if t.dim() == 2:
            t = t.unsqueeze(0)
        if t.dim() != 3:
            raise ValueError(f"HeadScores.per_sample_raw must be [samples, layers, heads], got shape {tuple(t.shape)}")
        self.per_sample_raw = t.detach().cpu()

    # ---- views ---------------------------------------------------------------------------
    @property
    def n_samples(self) -> int:
        return self.per_sample_raw.shape[0]

    @property
    def n_layers(self) -> int:
        return self.per_sample_raw.shape[1]

    @property
    def n_heads(self) -> int:
        return self.per_sample_raw.shape[2]

    @property
    def per_sample(self) -> torch.Tensor:
        """Per-sample scores clipped to [0, 1]."""
        return self.per_sample_raw.clamp(0.0, 1.0)  # [N, L, H]

    @property
    def scores(self) -> torch.Tensor:
        """Mean over samples of the clipped scores."""
        return self.per_sample.mean(0)  # [L, H]

    @property
    def raw(self) -> torch.Tensor:
        """Mean over samples of the unclipped scores."""
        return self.per_sample_raw.mean(0)  # [L, H]

    @property
    def clean_accuracy(self) -> float | None:
        return None if self.clean_correct is None else float(torch.as_tensor(self.clean_correct).float().mean())

    def ranking(self) -> list[Head]:
        """All heads, best first (ties broken by (layer, head))."""
        flat = self.scores.flatten()
        order = sorted(range(flat.numel()), key=lambda i: (-float(flat[i]), i))
        return [Head(i // self.n_heads, i % self.n_heads) for i in order]

    def top(self, k: int) -> list[Head]:
        if not 0 <= k <= self.n_layers * self.n_heads:
            raise ValueError(f"top(k): k={k} is outside 0..{self.n_layers * self.n_heads}")
        return self.ranking()[:k]

    def __getitem__(self, head: Head | tuple[int, int]) -> float:
        h = Head.from_any(head)
        return float(self.scores[h.layer, h.head])

    def to_dataframe(self):
        """One row per head: layer, head, kv_group, score, raw, std, frac_important, rank."""
        import pandas as pd

        ps = self.per_sample
        rank = {h: r for r, h in enumerate(self.ranking(), start=1)}
        group = self.n_heads // self.n_kv_heads if self.n_kv_heads else 1
        rows = []
        for l in range(self.n_layers):
            for h in range(self.n_heads):
                rows.append({
                    "task": self.task, "kind": self.kind, "layer": l, "head": h, "kv_group": h // group,
                    "score": float(self.scores[l, h]), "raw": float(self.raw[l, h]),
                    "std": float(ps[:, l, h].std()) if self.n_samples > 1 else 0.0,
                    "rank": rank[Head(l, h)],
                })
        return pd.DataFrame(rows)

    def __repr__(self) -> str:
        """A short summary: kind, task, shape, samples and the top 5 heads (not the tensors)."""
        finite = bool(torch.isfinite(self.per_sample_raw).all())
        top = ", ".join(f"{h}={self[h]:.3f}" for h in self.top(min(5, self.n_layers * self.n_heads))) \
            if finite else "n/a (non-finite scores)"
        kv = f", n_kv_heads={self.n_kv_heads}" if self.n_kv_heads is not None else ""
        return (f"HeadScores(kind={self.kind!r}, task={self.task!r}, {self.n_layers} layers x {self.n_heads} heads"
                f"{kv}, n_samples={self.n_samples}, top 5: {top})")

    __str__ = __repr__

    # ---- persistence ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def lst(t):
            return None if t is None else torch.as_tensor(t).tolist()

        return {"schema": "headscope.head_scores", "schema_version": 1, "task": self.task, "kind": self.kind,
                "n_kv_heads": self.n_kv_heads, "per_sample_raw": lst(self.per_sample_raw),
                "clean_metric": lst(self.clean_metric), "corrupt_metric": lst(self.corrupt_metric),
                "clean_correct": lst(self.clean_correct), "settings": self.settings}

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), default=str)
        if path is not None:
            write_text(path, text)
        return text

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> "HeadScores":
        s = str(path_or_text)
        data = json.loads(s if s.lstrip().startswith("{") else Path(s).read_text())
        if data.get("schema") != "headscope.head_scores":
            raise ValueError("not a headscope scores file: the 'schema' field must be 'headscope.head_scores'")
        where = "(JSON text)" if s.lstrip().startswith("{") else s
        raw = data.get("per_sample_raw")
        if raw is None:
            raise ValueError(f"scores file {where}: the 'per_sample_raw' field is missing; expected a "
                             "[samples][layers][heads] list of numbers (re-save it with HeadScores.to_json)")
        _check_numeric_grid(raw, "per_sample_raw", where)
        n = len(raw) if _depth(raw) == 3 else 1
        for k in ("clean_metric", "corrupt_metric", "clean_correct"):
            if data.get(k) is not None:
                _check_numeric_grid(data[k], k, where, ndim=1, n=n, boolean=k == "clean_correct")
        t = lambda k, dt=torch.float64: None if data.get(k) is None else torch.tensor(data[k], dtype=dt)
        return cls(task=data["task"], kind=data.get("kind", "receiver"), n_kv_heads=data.get("n_kv_heads"),
                   per_sample_raw=t("per_sample_raw"), clean_metric=t("clean_metric"),
                   corrupt_metric=t("corrupt_metric"), clean_correct=t("clean_correct", torch.bool),
                   settings=data.get("settings") or {})
