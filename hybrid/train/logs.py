"""Training logs: one JSON line per log step in OUT/log.jsonl, and a plotly figure of it (OUT/training.html)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["JsonlLog", "read_log", "plot_log"]


class JsonlLog:
    """Append-only JSON-lines log (one line per record, flushed). Only the main process writes."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path, self.enabled = Path(path), enabled
        self._f = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record, default=float) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_log(path: Path) -> list[dict[str, Any]]:
    """The log's step and evaluation records (events such as stage_start or warmup_step left out); after a
    resume, the records of steps redone replace the earlier ones."""
    recs: dict[tuple, dict] = {}
    events = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if "event" in r:
            events.append(r)
        elif "step" in r and "stage" in r:
            recs[(r["stage_index"], r["step"], "eval" if any(k.startswith("eval_") for k in r) else "train")] = r
        else:
            events.append(r)
    return [recs[k] for k in sorted(recs)]


def plot_log(path: Path, out: Path) -> Path:
    """Loss terms, learning rate and evaluations per stage against the global step, as one plotly HTML page."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from headscope.io import write_text

    recs = read_log(path)
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, subplot_titles=("loss", "learning rate", "evaluations"))
    offset, offsets = 0, {}
    for r in recs:  # global step = step within stage + steps of the earlier stages
        offsets.setdefault(r["stage_index"], None)
    last = {}
    for r in recs:
        last[r["stage_index"]] = max(last.get(r["stage_index"], 0), r["step"])
    for i in sorted(last):
        offsets[i] = offset
        offset += last[i]
    series: dict[tuple[str, int], tuple[list, list]] = {}
    for r in recs:
        x = offsets[r["stage_index"]] + r["step"]
        for k, v in r.items():
            if isinstance(v, (int, float)) and (k.startswith("loss") or k == "lr" or k.startswith("eval_")):
                xs, ys = series.setdefault((k, r["stage"]), ([], []))
                xs.append(x)
                ys.append(v)
    for (k, stage), (xs, ys) in series.items():
        row = 2 if k == "lr" else 3 if k.startswith("eval_") else 1
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers" if row == 3 else "lines",
                                 name=f"{stage}: {k}"), row=row, col=1)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="step (all stages)", row=3, col=1)
    fig.update_layout(height=900, title="hybrid.train")
    write_text(out, fig.to_html(include_plotlyjs="cdn"))
    return Path(out)
