"""Head report of the shipped reference model (headscope.load_model("default")), on the CPU.

    python experiments/report_reference_heads.py                   # ~8-15 min on 2 busy cores
    python experiments/report_reference_heads.py --n-niah 8 --n-knockout 8 --quick-path   # faster

Prints, and writes docs/results/reference_heads_cpu/reference_heads.json (+ the 7:1 mask and up to 3 small HTML
figures):
NIAH receiver scores (retrieval-critical fraction at thresholds 0.05 / 0.1 / 0.2, per-layer counts,
top 10 with KV groups), iterated path patching (per round, convergence, combined score), reasoning
family scores (the families the model solves), fusion ("frac") and the 7:1 global_per_layer_min mask,
ranking stability over n, the NIAH knockout curve (top-k vs 5 random seeds, mean ablation), proxies
vs exact scores, and adjacent-layer similarity next to the per-layer spread of head scores.
See docs/reference_heads.md for the numbers of one run and their reading.
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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-niah", type=int, default=16, help="NIAH pairs scored (receivers, senders, proxies)")
    p.add_argument("--context", type=int, default=512, help="NIAH prompt length in tokens")
    p.add_argument("--n-reason", type=int, default=16, help="pairs per reasoning family")
    p.add_argument("--n-knockout", type=int, default=16, help="fresh NIAH pairs for the knockout curve")
    p.add_argument("--knockout-seed", type=int, default=1000, help="seed of the knockout pairs (not the scored ones)")
    p.add_argument("--path-k", type=int, default=3, help="receivers per round of iterated path patching")
    p.add_argument("--path-rounds", type=int, default=3)
    p.add_argument("--n-path", type=int, default=None, help="pairs for path patching (default: all NIAH pairs)")
    p.add_argument("--out", default=str(ROOT / "docs/results/reference_heads_cpu/reference_heads.json"))
    p.add_argument("--mask-out", default=str(ROOT / "docs/results/reference_heads_cpu/reference_mask_7to1.json"))
    p.add_argument("--figures", default=str(ROOT / "docs/figures"), help="folder for the HTML figures ('' = none)")
    p.add_argument("--progress", action="store_true", help="show tqdm bars")
    a = p.parse_args()
    for name in ("threads", "n_niah", "context", "n_reason", "n_knockout", "path_k", "path_rounds"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if a.n_niah < 2:
        raise SystemExit("--n-niah must be >= 2 (ranking stability needs two samples)")
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


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    import headscope
    from headscope.ablation import answer_accuracy
    from headscope.fusion import fuse
    from headscope.knockout import auc, knockout_curve
    from headscope.proxies import attention_retrieval_score, attribution_patching, compare_to_exact
    from headscope.selection import select
    from headscope.senders import iterated_path_patching
    from headscope.similarity import adjacent_layer_similarity, head_score_spread, layer_similarity
    from headscope.stability import ranking_stability, samples_to_stabilize
    from headscope.tasks import get_task

    t_start, timings = time.time(), {}
    model, tok = headscope.load_model(a.model)
    arch = headscope.describe(model)
    L, H, KV = arch.n_layers, arch.n_heads, arch.n_kv_heads
    group = H // KV
    total = L * H
    out: dict = {"command": "python experiments/report_reference_heads.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k in ("n_niah", "context", "n_reason",
                                                                           "n_knockout", "path_k", "path_rounds",
                                                                           "threads")),
                 "model": {"layers": L, "heads": H, "kv_heads": KV, "total_heads": total},
                 "settings": {k: v for k, v in vars(a).items() if k not in ("out", "mask_out", "figures")}}
    print(f"model: {L} layers x {H} query heads ({KV} KV heads, {group} query heads per KV group) = {total} heads; "
          f"torch threads {a.threads}")

    # ---- 1. NIAH receiver scores --------------------------------------------------------------
    section(f"NIAH receiver scores ({a.n_niah} pairs, {a.context} tokens, depths uniform 0..1)")
    t = time.time()
    niah_task = get_task("niah", context_length=a.context, depth="uniform")
    pairs = niah_task.tokenized(tok, n=a.n_niah, seed=0)
    niah = headscope.score(model, pairs, tokenizer=tok, progress=a.progress)
    timings["niah_receiver_s"] = time.time() - t
    s = niah.scores  # [L, H]
    print(f"clean accuracy {niah.clean_accuracy:.3f}, {niah.n_samples} pairs kept, "
          f"{timings['niah_receiver_s']:.0f} s")
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
    mass = s.sum(1) / s.sum()  # [L]
    print("share of the total score per layer:", [round(float(x), 3) for x in mass])
    top10 = head_rows(niah, 10, group)
    print("top 10 heads:")
    print_rows(top10)
    out["niah"] = {"n_pairs": niah.n_samples, "context": a.context, "clean_accuracy": niah.clean_accuracy,
                   "critical": crit, "score_share_per_layer": [float(x) for x in mass], "top10": top10,
                   "scores": s.tolist(), "seconds": timings["niah_receiver_s"]}

    # ---- 2. sender scores: iterated path patching ---------------------------------------------------
    n_path = a.n_path or a.n_niah
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
    comb_top = head_rows(comb, 10, group)
    print("combined (max of receiver and sender) top 10:")
    print_rows(comb_top)
    gained = [str(h) for h in comb.top(10) if h not in niah.top(10)]
    print(f"heads in the combined top 10 but not the receiver top 10: {gained or 'none'}")
    out["path_patching"] = {"k": a.path_k, "max_rounds": a.path_rounds, "n_pairs": n_path, "rounds": rounds,
                            "converged": res.converged, "found": [str(h) for h in res.found()],
                            "combined_top10": comb_top, "new_in_combined_top10": gained,
                            "sender_scores": res.sender.scores.tolist(), "seconds": timings["path_patching_s"]}

    # ---- 3. reasoning families, fusion and the 7:1 mask -------------------------------------------
    section(f"reasoning families ({a.n_reason} pairs each), fusion and the 7:1 mask")
    t = time.time()
    family_acc, reasoning = {}, {}
    for fam in ALL_FAMILIES:
        fam_pairs = get_task(fam).tokenized(tok, n=a.n_reason, seed=0)
        family_acc[fam] = answer_accuracy(model, fam_pairs)
        solved = family_acc[fam] >= SOLVED_MIN
        print(f"{fam:>10}: clean accuracy {family_acc[fam]:.3f} -> {'scored and fused' if solved else 'left out (not solved)'}")
        if solved:
            reasoning[fam] = headscope.score(model, fam_pairs, tokenizer=tok, progress=a.progress)
            rows = head_rows(reasoning[fam], 5, group)
            print("            top 5: " + ", ".join(f"{r['head']} {r['score']:.3f}" for r in rows))
    timings["reasoning_s"] = time.time() - t
    tasks = {"niah": comb, **reasoning}
    fused = fuse(tasks, stability="frac")
    fused_top = [{"head": str(h), "score": round(float(fused[h]), 4), "kv_group": h.head // group}
                 for h in fused.top(10)]
    print(f"fused ({' + '.join(tasks)}, equal weights, stability 'frac' at 0.1) top 10: "
          + ", ".join(f"{r['head']} {r['score']:.3f}" for r in fused_top))
    mask = select(fused, ratio="7:1", strategy="global_per_layer_min", model=model)
    Path(a.mask_out).parent.mkdir(parents=True, exist_ok=True)
    mask.to_json(a.mask_out)
    fa = sorted(mask.fa_heads)
    niah_only = select(niah, ratio="7:1", strategy="global_per_layer_min", model=model)
    print(f"7:1 mask (global_per_layer_min, K={len(fa)}): {[str(h) for h in fa]}; per layer "
          f"{mask.per_layer_counts()} -> {a.mask_out}")
    print(f"NIAH-only 7:1 mask shares {len(set(fa) & set(niah_only.fa_heads))}/{len(fa)} heads with the fused one")
    out["reasoning"] = {"clean_accuracy": family_acc, "solved_min": SOLVED_MIN, "fused_tasks": list(tasks),
                        "top5": {f: head_rows(r, 5, group) for f, r in reasoning.items()},
                        "seconds": timings["reasoning_s"]}
    out["fusion"] = {"stability": "frac", "threshold": 0.1, "top10": fused_top, "scores": fused.scores.tolist()}
    out["mask_7to1"] = {"path": str(Path(a.mask_out).relative_to(ROOT)) if Path(a.mask_out).is_relative_to(ROOT)
                        else a.mask_out, "fa_heads": [str(h) for h in fa], "per_layer": mask.per_layer_counts(),
                        "shared_with_niah_only_mask": len(set(fa) & set(niah_only.fa_heads))}

    # ---- 4. ranking stability ---------------------------------------------------------------------
    section("ranking stability over samples (20 random subsets per n)")
    stab = {}
    for name, sc in {"niah": niah, **reasoning}.items():
        df = ranking_stability(sc, n_boot=20)
        g = df.groupby("n")[["spearman", "topk_overlap"]].mean()
        n_sp = samples_to_stabilize(df, 0.9)
        n_ov = samples_to_stabilize(df, 0.9, column="topk_overlap")
        stab[name] = {"k": int(df["k"].iloc[0]), "samples_to_stabilize_spearman_0.9": n_sp,
                      "samples_to_stabilize_topk_0.9": n_ov,
                      "curve": {int(n): {"spearman": round(float(r.spearman), 4),
                                         "topk_overlap": round(float(r.topk_overlap), 4)} for n, r in g.iterrows()}}
        pick = [n for n in (1, 2, 4, 6, 8, 12, 16) if n in g.index]
        print(f"{name}: spearman " + ", ".join(f"n={n} {g.loc[n, 'spearman']:.3f}" for n in pick))
        print(f"{'':>{len(name)}}  top-{stab[name]['k']} overlap " + ", ".join(
            f"n={n} {g.loc[n, 'topk_overlap']:.2f}" for n in pick))
        print(f"{'':>{len(name)}}  stable (mean spearman >= 0.9 from then on) at n = {n_sp}; "
              f"top-{stab[name]['k']} overlap >= 0.9 at n = {n_ov}")
        if name == "niah":
            stab_df = df
    out["stability"] = stab

    # ---- 5. knockout ----------------------------------------------------------------------------------
    section(f"NIAH knockout (mean ablation, {a.n_knockout} fresh pairs, seed {a.knockout_seed}, 5 random seeds)")
    t = time.time()
    ko = knockout_curve(model, "niah", niah, tokenizer=tok, kind="mean", max_fraction=0.1, n_random=5,
                        n_samples=a.n_knockout, seed=a.knockout_seed, progress=a.progress,
                        context_length=a.context, depth="uniform")
    timings["knockout_s"] = time.time() - t
    top = ko[ko.selection == "top"].set_index("k")
    rnd = ko[ko.selection == "random"].groupby("k")["accuracy"]
    print(f"  {'k':>3} {'% heads':>7} {'top-k acc':>9} {'random mean':>11} {'random min..max':>15}")
    curve = []
    for k in sorted(top.index):
        rm = float(rnd.mean().get(k, top.loc[k, "accuracy"]))
        lo, hi = float(rnd.min().get(k, rm)), float(rnd.max().get(k, rm))
        curve.append({"k": int(k), "fraction": float(top.loc[k, "fraction"]), "top": float(top.loc[k, "accuracy"]),
                      "random_mean": rm, "random_min": lo, "random_max": hi})
        print(f"  {k:>3} {100 * top.loc[k, 'fraction']:>6.1f}% {top.loc[k, 'accuracy']:>9.3f} {rm:>11.3f} "
              f"{lo:>7.3f}..{hi:.3f}")
    summary = auc(ko)
    k5 = max(1, round(0.05 * total))
    r5 = ko[(ko.selection == "random") & (ko.k == k5)]["accuracy"].tolist()
    print(f"AUC (mean accuracy over 0..10% knocked out): top {summary['top']:.3f}, random {summary['random']:.3f}, "
          f"gap {summary['gap']:.3f}")
    print(f"top 5% ({k5} heads {[str(h) for h in niah.top(k5)]}): {top.loc[0, 'accuracy']:.3f} -> "
          f"{top.loc[k5, 'accuracy']:.3f}; {k5} random heads: mean {np.mean(r5):.3f} (each {[round(x, 3) for x in r5]}); "
          f"{timings['knockout_s']:.0f} s")
    out["knockout"] = {"kind": "mean", "n_pairs": a.n_knockout, "seed": a.knockout_seed, "curve": curve,
                       "auc": summary, "k_5pct": k5, "top_5pct_heads": [str(h) for h in niah.top(k5)],
                       "intact": float(top.loc[0, "accuracy"]), "top_5pct": float(top.loc[k5, "accuracy"]),
                       "random_5pct_each": r5, "random_5pct_mean": float(np.mean(r5)),
                       "seconds": timings["knockout_s"]}

    # ---- 6. proxies -----------------------------------------------------------------------------------
    section(f"proxies vs exact receiver scores ({a.n_niah} NIAH pairs)")
    t = time.time()
    attn = attention_retrieval_score(model, pairs, progress=a.progress)
    atp = attribution_patching(model, pairs, progress=a.progress)
    timings["proxies_s"] = time.time() - t
    prox = {}
    for name, p in (("attention_retrieval", attn), ("attribution_patching", atp)):
        prox[name] = {f"k{k}": compare_to_exact(p, niah, k=k) for k in (3, 8)}
        c3, c8 = prox[name]["k3"], prox[name]["k8"]
        prox[name]["top5"] = [str(h) for h in p.top(5)]
        print(f"{name:>21}: spearman {c3['spearman']:.3f}, kendall {c3['kendall']:.3f}, top-3 overlap "
              f"{c3['topk_overlap']:.2f}, top-8 overlap {c8['topk_overlap']:.2f}; its top 5 {prox[name]['top5']}")
    print(f"({timings['proxies_s']:.0f} s for both)")
    out["proxies"] = prox

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

        fig_dir = Path(a.figures)
        fig_dir.mkdir(parents=True, exist_ok=True)
        figs = {"reference_niah_heatmap.html": plots.heatmap(niah, mask=mask, title="reference model: NIAH receiver "
                                                             "scores (red squares: fused 7:1 FA heads)"),
                "reference_knockout.html": plots.knockout_plot(ko, title="reference model: NIAH knockout (mean)"),
                "reference_stability.html": plots.stability_plot(stab_df, title="reference model: NIAH ranking "
                                                                 "stability")}
        for name, fig in figs.items():
            plots.save(fig, fig_dir / name, include_plotlyjs="cdn")  # ~10 KB each instead of 4.6 MB
        print(f"\nfigures: {', '.join(str(fig_dir / n) for n in figs)}")
        out["figures"] = sorted(figs)

    timings["total_s"] = time.time() - t_start
    out["timings"] = {k: round(v, 1) for k, v in timings.items()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"total {timings['total_s']:.0f} s -> {a.out}")


if __name__ == "__main__":
    main()
