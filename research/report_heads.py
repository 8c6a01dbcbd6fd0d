"""Head report of any model headscope can load: one command, JSON + figures + a markdown report.

    python -m research.report_heads --model default       # the reference model, CPU
    python -m research.report_heads --model smollm2-135m --device cuda --dtype bfloat16   # H200: <= 6 min
    python -m research.report_heads --model default --into-docs   # rewrite the tracked report in docs/

Where it writes: by default one results folder, runs/<date>_report_heads_<model>/ (heads.json, mask_7to1.json,
heads.md, figures/), so a run leaves the checkout's tracked files alone. --into-docs writes where the published
report lives instead: docs/results/<model>/, docs/<model>_heads.md and docs/figures/. --out-dir, --md and
--figures set each place explicitly (the job launcher passes all three).

Sections: NIAH receiver scores (retrieval-critical fraction at thresholds 0.05 / 0.1 / 0.2, per-layer counts,
top 10 with KV groups), iterated path patching (sender scores per round, combined score), receiver scores
on the reasoning families the model solves (>= 90% clean), stability-weighted fusion ("frac") and the 7:1
global_per_layer_min mask, ranking stability over n, NIAH knockout curves (top-k vs random seeds) with the
paper's corrupted-activation patch ("patch") AND with mean ablation ("mean"), proxies vs exact scores,
adjacent-layer similarity next to the per-layer spread of head scores. Writes <out-dir>/heads.json,
<out-dir>/mask_7to1.json, HTML figures (heatmaps, knockout, stability, similarity) into --figures, and a
markdown report (--md) that states, for each of the paper's head-level claims (sparse ~6.5%, scattered over
layers, stable after ~6 samples, top-1% knockout collapses retrieval while random does not), what this
model shows. A registry model's task defaults (headscope.zoo) are applied to its tasks.
Defaults: --device cpu uses the CPU sizes below; --device cuda raises unset sizes to the GPU sizes.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = (0.05, 0.1, 0.2)  # "retrieval-critical": mean clipped receiver score >= threshold (0.1 is the headline)
ALL_FAMILIES = ("arithmetic", "comparison", "binding", "two_hop")
SOLVED_MIN = 0.9  # a reasoning family enters the fusion only when the model solves >= 90% of its clean prompts
KNOCKOUT_KINDS = ("patch", "mean")  # passed explicitly: the paper's corrupted-activation patch, then mean ablation
PAPER = {"critical_fraction": 0.065, "stable_samples": 6}
#            n_niah context n_reason n_knockout path_k path_rounds
SIZES = {"cpu": (16, 512, 16, 16, 3, 3), "cuda": (24, 2048, 16, 24, 3, 3)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def slug(model: str) -> str:
    name = "reference" if model == "default" else Path(model).name or model
    return "".join(c if c.isalnum() else "_" for c in name).strip("_").lower()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a registry name (headscope.zoo.known_models()) or a folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-niah", type=int, default=None, help="NIAH pairs scored (receivers, senders, proxies)")
    p.add_argument("--context", type=int, default=None, help="NIAH prompt length in tokens")
    p.add_argument("--n-reason", type=int, default=None, help="pairs per reasoning family")
    p.add_argument("--families", default=",".join(ALL_FAMILIES), help="reasoning families ('' = none)")
    p.add_argument("--n-knockout", type=int, default=None, help="fresh NIAH pairs for the knockout curves")
    p.add_argument("--knockout-seed", type=int, default=1000, help="seed of the knockout pairs (not the scored ones)")
    p.add_argument("--n-random", type=int, default=5, help="random head sets per knockout point")
    p.add_argument("--path-k", type=int, default=None, help="receivers per round of iterated path patching")
    p.add_argument("--path-rounds", type=int, default=None)
    p.add_argument("--n-path", type=int, default=None, help="pairs for path patching (default: all NIAH pairs)")
    p.add_argument("--n-boot", type=int, default=20, help="random subsets per n for the stability curve")
    p.add_argument("--out-dir", default=None,
                   help="results folder (default runs/<date>_report_heads_<model>; with --into-docs "
                        "docs/results/<model>)")
    p.add_argument("--md", default=None, help="markdown report (default <out-dir>/heads.md; with --into-docs "
                                              "docs/<model>_heads.md; '' = none)")
    p.add_argument("--figures", default=None, help="folder for the HTML figures (default <out-dir>/figures; with "
                                                   "--into-docs docs/figures; '' = none)")
    p.add_argument("--into-docs", action="store_true",
                   help="write into the checkout's tracked docs (docs/results/<model>, docs/<model>_heads.md, "
                        "docs/figures) instead of a results folder under runs/")
    p.add_argument("--progress", action="store_true", help="show tqdm bars")
    a = p.parse_args(argv)
    sizes = SIZES["cuda" if str(a.device).startswith("cuda") else "cpu"]
    for name, value in zip(("n_niah", "context", "n_reason", "n_knockout", "path_k", "path_rounds"), sizes):
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.n_path is None and str(a.device).startswith("cuda"):
        a.n_path = 12  # path patching is the slowest part: half the NIAH pairs keeps the H200 run <= 6 min
    for name in ("threads", "n_niah", "context", "n_reason", "n_knockout", "path_k", "path_rounds", "n_boot"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if a.n_niah < 2:
        raise SystemExit("--n-niah must be >= 2 (ranking stability needs two samples)")
    a.families = tuple(f for f in a.families.split(",") if f)
    bad = [f for f in a.families if f not in ALL_FAMILIES]
    if bad:
        raise SystemExit(f"--families: unknown {bad}; choose from {ALL_FAMILIES}")
    a.slug = slug(a.model)
    if a.into_docs:
        out_dir, md = ROOT / "docs/results" / a.slug, ROOT / "docs" / f"{a.slug}_heads.md"
        figures = ROOT / "docs/figures"
    else:
        out_dir = Path("runs") / f"{time.strftime('%Y-%m-%d')}_report_heads_{a.slug}"
        out_dir = Path(a.out_dir) if a.out_dir else out_dir
        md, figures = out_dir / "heads.md", out_dir / "figures"
    a.out_dir = Path(a.out_dir) if a.out_dir else out_dir
    a.md = md if a.md is None else (Path(a.md) if a.md else None)
    a.figures = str(figures) if a.figures is None else a.figures
    return a


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 76 - len(title)))


def head_rows(s, k: int, group: int) -> list[dict]:
    """Top-k heads of HeadScores ``s`` with score, KV group and the fraction of samples >= 0.1."""
    ps = s.per_sample  # [N, L, H]
    return [{"head": str(h), "layer": h.layer, "index": h.head, "score": round(float(s[h]), 4),
             "kv_group": h.head // group, "frac_samples_ge_0.1": round(float((ps[:, h.layer, h.head] > 0.1)
                                                                             .double().mean()), 3)}
            for h in s.top(k)]


def print_rows(rows: list[dict]) -> None:
    print(f"  {'rank':>4} {'head':>8} {'score':>7} {'kv':>3} {'frac>0.1':>8}")
    for r, row in enumerate(rows, 1):
        print(f"  {r:>4} {row['head']:>8} {row['score']:>7.4f} {row['kv_group']:>3} {row['frac_samples_ge_0.1']:>8.2f}")


def knockout_section(model, tok, niah, a, total: int, kind: str, task_kwargs: dict) -> tuple[dict, object]:
    from headscope.knockout import auc, default_ks, knockout_curve

    k1, k5 = max(1, round(0.01 * total)), max(1, round(0.05 * total))
    ks = sorted(set(default_ks(total, 0.1)) | {k1, k5})
    t = time.time()
    ko = knockout_curve(model, "niah", niah, tokenizer=tok, kind=kind, ks=ks, n_random=a.n_random, n_samples=a.n_knockout,
                        seed=a.knockout_seed, progress=a.progress, **task_kwargs)
    top = ko[ko.selection == "top"].set_index("k")
    rnd = ko[ko.selection == "random"].groupby("k")["accuracy"]
    print(f"  [{kind}] {'k':>3} {'% heads':>7} {'top-k acc':>9} {'random mean':>11} {'random min..max':>15}")
    curve = []
    for k in sorted(top.index):
        rm = float(rnd.mean().get(k, top.loc[k, "accuracy"]))
        lo, hi = float(rnd.min().get(k, rm)), float(rnd.max().get(k, rm))
        curve.append({"k": int(k), "fraction": float(top.loc[k, "fraction"]), "top": float(top.loc[k, "accuracy"]),
                      "random_mean": rm, "random_min": lo, "random_max": hi})
        print(f"  [{kind}] {k:>3} {100 * top.loc[k, 'fraction']:>6.1f}% {top.loc[k, 'accuracy']:>9.3f} {rm:>11.3f} "
              f"{lo:>7.3f}..{hi:.3f}")
    summary = auc(ko)
    point = {c["k"]: c for c in curve}
    print(f"  [{kind}] AUC over 0..10%: top {summary['top']:.3f}, random {summary['random']:.3f}, gap "
          f"{summary['gap']:.3f}; intact {point[0]['top']:.3f}; top 1% ({k1} heads) {point[k1]['top']:.3f} vs random "
          f"{point[k1]['random_mean']:.3f}; top 5% ({k5}) {point[k5]['top']:.3f} vs random {point[k5]['random_mean']:.3f}; "
          f"{time.time() - t:.0f} s")
    return {"kind": kind, "n_pairs": a.n_knockout, "seed": a.knockout_seed, "curve": curve, "auc": summary,
            "k_1pct": k1, "k_5pct": k5, "top_1pct_heads": [str(h) for h in niah.top(k1)],
            "intact": point[0]["top"], "top_1pct": point[k1]["top"], "random_1pct_mean": point[k1]["random_mean"],
            "top_5pct": point[k5]["top"], "random_5pct_mean": point[k5]["random_mean"],
            "seconds": time.time() - t}, ko


def claims(out: dict) -> list[dict]:
    """The paper's head-level claims next to what this run shows (verdict: agrees / partly / disagrees)."""
    total = out["model"]["total_heads"]
    c = out["niah"]["critical"]["0.1"]
    rows = []
    frac = c["fraction"]
    rows.append({"claim": f"sparse: ~{PAPER['critical_fraction']:.1%} of heads are retrieval-critical",
                 "shows": f"{c['n']}/{total} = {frac:.1%} of heads score >= 0.1 on NIAH (at 0.05: "
                          f"{out['niah']['critical']['0.05']['fraction']:.1%})",
                 "verdict": "agrees" if 0.02 <= frac <= 0.15 else ("partly (sparser)" if 0 < frac < 0.02 else
                                                                    "disagrees")})
    n_layers, share = c["layers_with_any"], c["share_in_top2_layers"]
    rows.append({"claim": "scattered over layers (not concentrated in a few)",
                 "shows": f"the critical heads sit in {n_layers} of {out['model']['layers']} layers; the 2 fullest "
                          f"layers hold {share:.0%} of them" if share is not None else "no critical heads",
                 "verdict": "agrees" if n_layers >= 3 and (share or 1) <= 0.7 else
                            ("partly" if n_layers >= 2 else "disagrees")})
    st = out["stability"].get("niah", {})
    n_sp, n_ov = st.get("samples_to_stabilize_spearman_0.9"), st.get("samples_to_stabilize_topk_0.9")
    n_max = out["niah"]["n_pairs"]
    rows.append({"claim": f"rankings stable after ~{PAPER['stable_samples']} samples",
                 "shows": f"mean Spearman vs the full ranking >= 0.9 from n = {n_sp}, top-{st.get('k')} overlap >= 0.9 "
                          f"from n = {n_ov} (of {n_max} pairs)",
                 "verdict": "agrees" if n_sp is not None and n_sp <= 8 else
                            ("partly" if n_sp is not None else "disagrees (not within the pairs scored)")})
    for kind, ko in out["knockout"].items():
        intact, top1, rnd1 = ko["intact"], ko["top_1pct"], ko["random_1pct_mean"]
        collapse, spared = top1 <= 0.5 * intact, rnd1 >= 0.8 * intact
        rows.append({"claim": f"top-1% knockout collapses retrieval, random does not ({kind})",
                     "shows": f"intact {intact:.2f}; top {ko['k_1pct']} heads knocked out -> {top1:.2f}; "
                              f"{ko['k_1pct']} random heads -> {rnd1:.2f} (mean of {out['settings']['n_random']}); "
                              f"top 5% -> {ko['top_5pct']:.2f} vs random {ko['random_5pct_mean']:.2f}",
                     "verdict": "agrees" if collapse and spared else ("partly" if (collapse or top1 < rnd1) else
                                                                      "disagrees")})
    return rows


def fig_link(a, name: str) -> str:
    """A figure's link from the markdown report: relative to the report's folder, absolute if no common root."""
    import os

    fig = Path(a.figures).resolve() / name
    try:
        return Path(os.path.relpath(fig, Path(a.md).resolve().parent)).as_posix()
    except ValueError:
        return fig.as_posix()


def write_markdown(path: Path, out: dict, a) -> None:
    from headscope.io import write_text

    m, n = out["model"], out["niah"]
    lines = [f"# Head report: `{a.model}`", "",
             f"{m['layers']} layers x {m['heads']} query heads ({m['kv_heads']} KV heads) = {m['total_heads']} heads; "
             f"{a.dtype} on {out['device']}. Made by one command (total {out['timings']['total_s']:.0f} s):", "",
             "```bash", out["command"], "```", "",
             f"Numbers: `{out['json']}`; figures (HTML, plotly.js from its CDN): "
             + (", ".join(f"[{f}]({fig_link(a, f)})" for f in out.get("figures", [])) or "none") + ".",
             "", "## The paper's head-level claims on this model", "",
             "| claim | this model | verdict |", "| --- | --- | --- |"]
    lines += [f"| {r['claim']} | {r['shows']} | {r['verdict']} |" for r in out["claims"]]
    lines += ["", f"## NIAH receiver scores ({n['n_pairs']} pairs, {n['context']} tokens; clean accuracy "
              f"{n['clean_accuracy']:.3f}; {n['seconds_per_pair']:.1f} s per pair)", "",
              "| threshold | critical heads | layers with any | share in the 2 fullest layers |",
              "| --- | --- | --- | --- |"]
    for th, c in n["critical"].items():
        share = "-" if c["share_in_top2_layers"] is None else f"{c['share_in_top2_layers']:.0%}"
        lines.append(f"| {th} | {c['n']} / {m['total_heads']} = {c['fraction']:.1%} | {c['layers_with_any']} | {share} |")
    lines += ["", "| rank | head | score | KV group | samples with score > 0.1 |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {i} | {r['head']} | {r['score']:.3f} | {r['kv_group']} | {r['frac_samples_ge_0.1']:.0%} |"
              for i, r in enumerate(n["top10"], 1)]
    pp = out["path_patching"]
    lines += ["", f"## Sender scores (iterated path patching, k = {pp['k']}, <= {pp['max_rounds']} rounds, "
              f"{pp['n_pairs']} pairs)", ""]
    lines += [f"- round {r['round']}: receivers {', '.join(r['receivers'])} -> top senders "
              + (", ".join(f"{x['head']} {x['score']:.3f}" for x in r["top_senders"]) or "none > 0")
              for r in pp["rounds"]]
    lines += [f"- converged: {pp['converged']}; heads in the combined top 10 but not the receiver top 10: "
              f"{', '.join(pp['new_in_combined_top10']) or 'none'}", "",
              "## Reasoning families, fusion, 7:1 mask", "",
              "| family | clean accuracy | fused | top 5 heads |", "| --- | --- | --- | --- |"]
    r = out["reasoning"]
    for fam, acc in r["clean_accuracy"].items():
        top = ", ".join(f"{x['head']} {x['score']:.2f}" for x in r["top5"].get(fam, []))
        lines.append(f"| {fam} | {acc:.3f} | {'yes' if fam in r['fused_tasks'] else 'no (< 0.9)'} | {top or '-'} |")
    lines += ["", f"Fused ({' + '.join(r['fused_tasks'])}, stability 'frac'): "
              + ", ".join(f"{x['head']} {x['score']:.3f}" for x in out["fusion"]["top10"]),
              f"; 7:1 mask (K = {len(out['mask_7to1']['fa_heads'])}) per layer {out['mask_7to1']['per_layer']}.", "",
              "## Ranking stability", "", "| task | n for Spearman >= 0.9 | n for top-k overlap >= 0.9 |",
              "| --- | --- | --- |"]
    lines += [f"| {t} | {s['samples_to_stabilize_spearman_0.9']} | {s['samples_to_stabilize_topk_0.9']} (k = {s['k']}) |"
              for t, s in out["stability"].items()]
    lines += ["", "## Knockout (NIAH, fresh pairs)", "",
              "| ablation | intact | top 1% | random 1% | top 5% | random 5% | AUC top | AUC random |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind, ko in out["knockout"].items():
        lines.append(f"| {kind} | {ko['intact']:.2f} | {ko['top_1pct']:.2f} | {ko['random_1pct_mean']:.2f} | "
                     f"{ko['top_5pct']:.2f} | {ko['random_5pct_mean']:.2f} | {ko['auc']['top']:.3f} | "
                     f"{ko['auc']['random']:.3f} |")
    lines += ["", "## Proxies vs exact receiver scores (NIAH)", "", "| proxy | Spearman | Kendall | top-3 overlap | "
              "top-8 overlap |", "| --- | --- | --- | --- | --- |"]
    for name, pr in out["proxies"].items():
        lines.append(f"| {name} | {pr['k3']['spearman']:.3f} | {pr['k3']['kendall']:.3f} | "
                     f"{pr['k3']['topk_overlap']:.2f} | {pr['k8']['topk_overlap']:.2f} |")
    sim = out["similarity"]
    lines += ["", "## Layer similarity", "",
              "Adjacent-layer cosine similarity of the residual stream (in, out) per layer: "
              + ", ".join(f"L{r['layer']} {r['adjacent_similarity']:.2f}" for r in sim["per_layer"])
              + f"; first vs last {sim['first_vs_last']:.3f}.", "",
              "## Timings (s)", "", ", ".join(f"{k} {v}" for k, v in out["timings"].items()), ""]
    write_text(path, "\n".join(lines))


def save(a, out: dict) -> None:
    """Write heads.json and the run folder's README now (after every section: a run cut short keeps its parts)."""
    from headscope.io import write_text

    json_path = a.out_dir / "heads.json"
    out["json"] = str(json_path.relative_to(ROOT)) if json_path.is_relative_to(ROOT) else str(json_path)
    write_text(json_path, json.dumps(out, indent=1))
    write_text(a.out_dir / "README.md", "\n".join([  # the run folder's card (tests/docs/test_results_index.py)
        f"# {a.out_dir.name}", "", f"The head report on `{a.model}` (research/report_heads.py)"
        + ("." if "claims" in out else ", cut short: heads.json holds the sections finished so far."), "",
        f"- **made by**: `{out['command']}`", f"- **when**: {time.strftime('%Y-%m-%d')}",
        f"- **on**: {out['device']}, torch {torch.__version__}", f"- **cited by**: {a.md.name if a.md else '-'}", "",
        "| file | |", "|---|---|", "| `heads.json` | results (JSON) |"]
        + (["| `mask_7to1.json` | the fused 7:1 mask |"] if (a.out_dir / "mask_7to1.json").exists() else []) + [""]))


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    import headscope
    from headscope import zoo
    from headscope.ablation import answer_accuracy
    from headscope.fusion import fuse
    from headscope.io import write_text
    from headscope.proxies import attention_retrieval_score, attribution_patching, compare_to_exact
    from headscope.selection import select
    from headscope.senders import iterated_path_patching
    from headscope.similarity import adjacent_layer_similarity, head_score_spread, layer_similarity
    from headscope.stability import ranking_stability, samples_to_stabilize
    from headscope.tasks import get_task

    t_start, timings = time.time(), {}
    a.out_dir.mkdir(parents=True, exist_ok=True)
    model, tok = headscope.load_model(a.model, dtype=DTYPES[a.dtype], device=a.device)
    timings["load_s"] = time.time() - t_start
    arch = headscope.describe(model)
    L, H, KV = arch.n_layers, arch.n_heads, arch.n_kv_heads
    group = H // KV
    total = L * H
    defaults = {t: zoo.task_defaults(a.model, t) for t in ("niah", *ALL_FAMILIES)}
    flags = ("model", "device", "dtype", "threads", "n_niah", "context", "n_reason", "n_knockout", "path_k",
             "path_rounds", "n_random", "n_boot")
    out: dict = {"command": "python research/report_heads.py " + " ".join(
        f"--{k.replace('_', '-')} {getattr(a, k)}" for k in flags)
        + (f" --n-path {a.n_path}" if a.n_path is not None else "") + f" --families {','.join(a.families) or ''}"
        f" --out-dir {a.out_dir.relative_to(ROOT) if a.out_dir.is_relative_to(ROOT) else a.out_dir}"
        + (f" --md {a.md.relative_to(ROOT) if a.md.is_relative_to(ROOT) else a.md}" if a.md else " --md ''"),
        "device": str(torch.cuda.get_device_name()) if str(a.device).startswith("cuda") else str(a.device),
        "model": {"name": a.model, "layers": L, "heads": H, "kv_heads": KV, "total_heads": total},
        "settings": {k: getattr(a, k) for k in flags + ("knockout_seed", "families")}, "task_defaults": defaults}
    print(f"model {a.model}: {L} layers x {H} query heads ({KV} KV heads, {group} per KV group) = {total} heads; "
          f"{a.dtype} on {out['device']}; loaded in {timings['load_s']:.0f} s")

    # ---- 1. NIAH receiver scores --------------------------------------------------------------
    section(f"NIAH receiver scores ({a.n_niah} pairs, {a.context} tokens, depths uniform 0..1)")
    t = time.time()
    niah_kwargs = {**defaults["niah"], "context_length": a.context, "depth": "uniform"}
    pairs = get_task("niah", **niah_kwargs).tokenized(tok, n=a.n_niah, seed=0)
    niah = headscope.score(model, pairs, tokenizer=tok, progress=a.progress)
    timings["niah_receiver_s"] = time.time() - t
    s = niah.scores  # [L, H]
    print(f"clean accuracy {niah.clean_accuracy:.3f}, {niah.n_samples} pairs kept, "
          f"{timings['niah_receiver_s']:.0f} s ({timings['niah_receiver_s'] / len(pairs):.2f} s per pair)")
    crit = {}
    for th in THRESHOLDS:
        per_layer = (s >= th).sum(1).tolist()  # [L]
        n = int(sum(per_layer))
        top2 = sum(sorted(per_layer, reverse=True)[:2])
        crit[str(th)] = {"n": n, "fraction": n / total, "per_layer": per_layer,
                         "layers_with_any": int(sum(c > 0 for c in per_layer)),
                         "share_in_top2_layers": (top2 / n) if n else None}
        print(f"retrieval-critical (mean clipped score >= {th}): {n}/{total} = {n / total:.1%}; per layer "
              f"{per_layer}; in {crit[str(th)]['layers_with_any']} layers; share in the 2 fullest layers "
              f"{(top2 / n if n else float('nan')):.0%}")
    mass = s.sum(1) / s.sum().clamp_min(1e-12)  # [L]
    print("share of the total score per layer:", [round(float(x), 3) for x in mass])
    top10 = head_rows(niah, min(10, total), group)
    print("top 10 heads:")
    print_rows(top10)
    out["niah"] = {"n_pairs": niah.n_samples, "context": a.context, "clean_accuracy": niah.clean_accuracy,
                   "critical": crit, "score_share_per_layer": [float(x) for x in mass], "top10": top10,
                   "scores": s.tolist(), "seconds": timings["niah_receiver_s"],
                   "seconds_per_pair": timings["niah_receiver_s"] / len(pairs)}
    save(a, out)

    # ---- 2. sender scores: iterated path patching ---------------------------------------------------
    n_path = min(a.n_path or a.n_niah, len(pairs))
    section(f"iterated path patching (k={a.path_k} receivers per round, <= {a.path_rounds} rounds, {n_path} pairs)")
    t = time.time()
    res = iterated_path_patching(model, pairs[:n_path], tokenizer=tok, receiver_scores=niah, k=a.path_k,
                                 max_rounds=a.path_rounds, progress=a.progress)
    timings["path_patching_s"] = time.time() - t
    rounds = []
    for i, (receivers, send) in enumerate(res.rounds, 1):
        top = [h for h in send.top(5) if send[h] > 0]
        rows = [{"head": str(h), "score": round(float(send[h]), 4)} for h in top]
        rounds.append({"round": i, "receivers": [str(h) for h in receivers], "top_senders": rows,
                       "max_sender_score": float(send.scores.max())})
        print(f"round {i}: receivers {[str(h) for h in receivers]} -> top senders "
              + ", ".join(f"{r['head']} {r['score']:.3f}" for r in rows))
    print(f"converged: {res.converged} after {len(res.rounds)} rounds; heads found as receivers: "
          f"{[str(h) for h in res.found()]}; {timings['path_patching_s']:.0f} s")
    comb = res.combined
    comb_top = head_rows(comb, min(10, total), group)
    print("combined (max of receiver and sender) top 10:")
    print_rows(comb_top)
    gained = [str(h) for h in comb.top(min(10, total)) if h not in niah.top(min(10, total))]
    print(f"heads in the combined top 10 but not the receiver top 10: {gained or 'none'}")
    out["path_patching"] = {"k": a.path_k, "max_rounds": a.path_rounds, "n_pairs": n_path, "rounds": rounds,
                            "converged": res.converged, "found": [str(h) for h in res.found()],
                            "combined_top10": comb_top, "new_in_combined_top10": gained,
                            "sender_scores": res.sender.scores.tolist(), "seconds": timings["path_patching_s"]}
    save(a, out)

    # ---- 3. reasoning families, fusion and the 7:1 mask -------------------------------------------
    section(f"reasoning families ({a.n_reason} pairs each), fusion and the 7:1 mask")
    t = time.time()
    family_acc, reasoning = {}, {}
    for fam in a.families:
        fam_pairs = get_task(fam, **defaults[fam]).tokenized(tok, n=a.n_reason, seed=0)
        family_acc[fam] = answer_accuracy(model, fam_pairs)
        solved = family_acc[fam] >= SOLVED_MIN
        print(f"{fam:>10} {defaults[fam] or ''}: clean accuracy {family_acc[fam]:.3f} -> "
              f"{'scored and fused' if solved else 'left out (not solved)'}")
        if solved:
            reasoning[fam] = headscope.score(model, fam_pairs, tokenizer=tok, progress=a.progress)
            rows = head_rows(reasoning[fam], min(5, total), group)
            print("            top 5: " + ", ".join(f"{r['head']} {r['score']:.3f}" for r in rows))
    timings["reasoning_s"] = time.time() - t
    tasks = {"niah": comb, **reasoning}
    fused = fuse(tasks, stability="frac")
    fused_top = [{"head": str(h), "score": round(float(fused[h]), 4), "kv_group": h.head // group}
                 for h in fused.top(min(10, total))]
    print(f"fused ({' + '.join(tasks)}, equal weights, stability 'frac' at 0.1) top 10: "
          + ", ".join(f"{r['head']} {r['score']:.3f}" for r in fused_top))
    strategy = "global_per_layer_min" if round(total / 8) >= L else "global"  # tiny models: too few FA heads
    mask = select(fused, ratio="7:1", strategy=strategy, model=model)
    mask_path = a.out_dir / "mask_7to1.json"
    mask.to_json(mask_path)
    fa = sorted(mask.fa_heads)
    niah_only = select(niah, ratio="7:1", strategy=strategy, model=model)
    print(f"7:1 mask ({strategy}, K={len(fa)}): {[str(h) for h in fa]}; per layer "
          f"{mask.per_layer_counts()} -> {mask_path}")
    print(f"NIAH-only 7:1 mask shares {len(set(fa) & set(niah_only.fa_heads))}/{len(fa)} heads with the fused one")
    out["reasoning"] = {"clean_accuracy": family_acc, "solved_min": SOLVED_MIN, "fused_tasks": list(tasks),
                        "top5": {f: head_rows(r, min(5, total), group) for f, r in reasoning.items()},
                        "scores": {f: r.scores.tolist() for f, r in reasoning.items()},
                        "seconds": timings["reasoning_s"]}
    out["fusion"] = {"stability": "frac", "threshold": 0.1, "top10": fused_top, "scores": fused.scores.tolist()}
    out["mask_7to1"] = {"strategy": strategy, "path": str(mask_path.relative_to(ROOT)) if mask_path.is_relative_to(ROOT) else str(mask_path),
                        "fa_heads": [str(h) for h in fa], "per_layer": mask.per_layer_counts(),
                        "shared_with_niah_only_mask": len(set(fa) & set(niah_only.fa_heads))}
    save(a, out)

    # ---- 4. ranking stability ---------------------------------------------------------------------
    section(f"ranking stability over samples ({a.n_boot} random subsets per n)")
    stab, stab_df = {}, None
    for name, sc in {"niah": niah, **reasoning}.items():
        if sc.n_samples < 2:
            continue
        df = ranking_stability(sc, n_boot=a.n_boot)
        g = df.groupby("n")[["spearman", "topk_overlap"]].mean()
        n_sp = samples_to_stabilize(df, 0.9)
        n_ov = samples_to_stabilize(df, 0.9, column="topk_overlap")
        stab[name] = {"k": int(df["k"].iloc[0]), "samples_to_stabilize_spearman_0.9": n_sp,
                      "samples_to_stabilize_topk_0.9": n_ov,
                      "curve": {int(n): {"spearman": round(float(r.spearman), 4),
                                         "topk_overlap": round(float(r.topk_overlap), 4)} for n, r in g.iterrows()}}
        pick = [n for n in (1, 2, 4, 6, 8, 12, 16, 24) if n in g.index]
        print(f"{name}: spearman " + ", ".join(f"n={n} {g.loc[n, 'spearman']:.3f}" for n in pick))
        print(f"{'':>{len(name)}}  top-{stab[name]['k']} overlap " + ", ".join(
            f"n={n} {g.loc[n, 'topk_overlap']:.2f}" for n in pick))
        print(f"{'':>{len(name)}}  stable (mean spearman >= 0.9 from then on) at n = {n_sp}; "
              f"top-{stab[name]['k']} overlap >= 0.9 at n = {n_ov}")
        if name == "niah":
            stab_df = df
    out["stability"] = stab
    save(a, out)

    # ---- 5. knockout: the paper's corrupted-activation patch, then mean ablation --------------------
    out["knockout"], curves = {}, {}
    for kind in KNOCKOUT_KINDS:
        section(f"NIAH knockout ({kind}, {a.n_knockout} fresh pairs, seed {a.knockout_seed}, {a.n_random} random "
                "seeds)")
        out["knockout"][kind], curves[kind] = knockout_section(model, tok, niah, a, total, kind, niah_kwargs)
        timings[f"knockout_{kind}_s"] = out["knockout"][kind]["seconds"]
        save(a, out)

    # ---- 6. proxies -----------------------------------------------------------------------------------
    section(f"proxies vs exact receiver scores ({len(pairs)} NIAH pairs)")
    t = time.time()
    attn = attention_retrieval_score(model, pairs, progress=a.progress)
    atp = attribution_patching(model, pairs, progress=a.progress)
    timings["proxies_s"] = time.time() - t
    prox = {}
    for name, p in (("attention_retrieval", attn), ("attribution_patching", atp)):
        prox[name] = {f"k{k}": compare_to_exact(p, niah, k=min(k, total)) for k in (3, 8)}
        c3, c8 = prox[name]["k3"], prox[name]["k8"]
        prox[name]["top5"] = [str(h) for h in p.top(min(5, total))]
        print(f"{name:>21}: spearman {c3['spearman']:.3f}, kendall {c3['kendall']:.3f}, top-3 overlap "
              f"{c3['topk_overlap']:.2f}, top-8 overlap {c8['topk_overlap']:.2f}; its top 5 {prox[name]['top5']}")
    print(f"({timings['proxies_s']:.0f} s for both)")
    out["proxies"] = prox
    save(a, out)

    # ---- 7. layer similarity vs head spread ----------------------------------------------------------
    section("adjacent-layer similarity vs the spread of head scores inside each layer")
    sim = layer_similarity(model, pairs[:8])
    adj = adjacent_layer_similarity(sim)
    spread = head_score_spread(niah)
    print(f"  {'layer':>5} {'cos(in, out)':>12} {'NIAH max':>8} {'NIAH range':>10} {'std':>6} {'heads>=0.1':>10}")
    rows = []
    for l in range(L):
        row = {"layer": l, "adjacent_similarity": float(adj.similarity[l]), "max": float(spread["max"][l]),
               "range": float(spread["range"][l]), "std": float(spread["std"][l]), "n_above_0.1": int(spread.n_above[l])}
        rows.append(row)
        print(f"  {l:>5} {row['adjacent_similarity']:>12.3f} {row['max']:>8.3f} {row['range']:>10.3f} "
              f"{row['std']:>6.3f} {row['n_above_0.1']:>10}")
    far = float(np.asarray(sim)[1, L])
    print(f"cos(after layer 0, after layer {L - 1}) = {far:.3f}")
    out["similarity"] = {"per_layer": rows, "matrix": np.asarray(sim).tolist(), "first_vs_last": far}

    # ---- figures ----------------------------------------------------------------------------------------
    if a.figures:
        from headscope import plots

        fig_dir, p = Path(a.figures), a.slug
        figs = {f"{p}_niah_heatmap.html": plots.heatmap(niah, mask=mask, title=f"{a.model}: NIAH receiver scores "
                                                         "(red squares: fused 7:1 FA heads)"),
                f"{p}_sender_heatmap.html": plots.heatmap(res.sender, title=f"{a.model}: NIAH sender scores "
                                                          "(iterated path patching)"),
                f"{p}_fused_heatmap.html": plots.heatmap(fused, mask=mask, title=f"{a.model}: fused scores "
                                                         f"({' + '.join(tasks)})"),
                f"{p}_stability.html": plots.stability_plot(stab_df, title=f"{a.model}: NIAH ranking stability"),
                f"{p}_similarity.html": plots.similarity_plot(sim, title=f"{a.model}: residual-stream cosine "
                                                               "similarity between layers")}
        for kind, ko in curves.items():
            figs[f"{p}_knockout_{kind}.html"] = plots.knockout_plot(ko, title=f"{a.model}: NIAH knockout ({kind})")
        for fam, sc in reasoning.items():
            figs[f"{p}_{fam}_heatmap.html"] = plots.heatmap(sc, title=f"{a.model}: {fam} receiver scores")
        for name, fig in figs.items():
            plots.save(fig, fig_dir / name, include_plotlyjs="cdn")  # ~10 KB each instead of 4.6 MB
        print(f"\nfigures: {', '.join(str(fig_dir / n) for n in figs)}")
        out["figures"] = sorted(figs)

    timings["total_s"] = time.time() - t_start
    out["timings"] = {k: round(v, 1) for k, v in timings.items()}
    out["claims"] = claims(out)
    section("the paper's head-level claims")
    for r in out["claims"]:
        print(f"- {r['claim']}: {r['shows']} -> {r['verdict']}")
    save(a, out)
    json_path = a.out_dir / "heads.json"
    if a.md:
        write_markdown(a.md, out, a)
    print(f"total {timings['total_s']:.0f} s -> {json_path}" + (f", {a.md}" if a.md else ""))


if __name__ == "__main__":
    main()
