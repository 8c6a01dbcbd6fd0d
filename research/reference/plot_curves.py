"""Training curves of the shipped reference model's four H200 stages in one figure (plotly HTML).

    python research/reference/plot_curves.py      # -> docs/figures/reference_training.html (~15 KB, plotly.js via CDN)

Top: answer loss per row kind (multi-key, NIAH, reasoning; nats per answer token, a rolling mean of 4 logs)
and text loss; bottom: the held-out probe accuracies (32 prompts each). x: H200 training minutes, the stages
one after another (each stage continues the previous one's weights). Prints the probe values at the end
of each stage.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGES = [("stage 1", "2026-11-29_reference_pretrain_stage1/reference_train_log.jsonl"),
          ("stage 2", "2026-11-29_reference_pretrain_stage2/reference_train2_log.jsonl"),
          ("stage 3", "2026-11-29_reference_pretrain_stage3/reference_train3_log.jsonl"),
          ("stage 4", "2026-11-29_reference_pretrain_stage4_sweep/reference_train4_log.jsonl")]
LOSSES = ["loss_multikey_answer", "loss_niah_answer", "loss_reasoning_answer", "loss_text"]
PROBES = ["acc_niah@2048", "acc_multikey", "acc_reasoning", "acc_binding", "acc_two_hop"]


def load(results: Path) -> list[dict]:
    rows, offset = [], 0.0
    for stage, name in STAGES:
        recs = [json.loads(line) for line in (results / name).read_text().splitlines() if line.strip()]
        for r in recs:
            rows.append(dict(r, stage=stage, t=offset + r["minutes"]))
        offset += recs[-1]["minutes"]
    return rows


def rolling(xs: list, k: int = 4) -> list:
    out = []
    for i in range(len(xs)):
        window = [x for x in xs[max(0, i - k + 1): i + 1] if x is not None]
        out.append(sum(window) / len(window) if window else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=REPO / "docs/results")
    ap.add_argument("--out", type=Path, default=REPO / "docs/figures/reference_training.html")
    a = ap.parse_args()
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from headscope.plots import save

    rows = load(a.results)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("loss (nats per token; answers only except text)", "held-out probe accuracy"))
    for key in LOSSES:
        pts = [(r["t"], r.get(key)) for r in rows]
        fig.add_trace(go.Scatter(x=[t for t, _ in pts], y=rolling([v for _, v in pts]), name=key[5:], mode="lines"),
                      row=1, col=1)
    for key in PROBES:
        pts = [(r["t"], r[key]) for r in rows if key in r]
        fig.add_trace(go.Scatter(x=[t for t, _ in pts], y=[v for _, v in pts], name=key[4:], mode="lines+markers"),
                      row=2, col=1)
    ends = {}
    for r in rows:
        ends[r["stage"]] = r["t"]
    for stage, t in list(ends.items())[:-1]:
        fig.add_vline(x=t, line_dash="dot", line_color="grey")
    fig.update_xaxes(title_text="H200 training minutes (stages 1, 2, 3 back to back)", row=2, col=1)
    fig.update_layout(height=700, width=950, title="Reference model training (docs/reference_model.md)")
    print(f"wrote {save(fig, a.out, include_plotlyjs='cdn')}")
    for stage in ends:
        last = [r for r in rows if r["stage"] == stage and any(k in r for k in PROBES)][-1]
        print(f"{stage} (ends at {ends[stage]:.1f} min): "
              + ", ".join(f"{k[4:]} {last[k]:.2f}" for k in PROBES if k in last))


if __name__ == "__main__":
    main()
