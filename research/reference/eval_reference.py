"""Evaluate the reference model: NIAH by depth, multi-key NIAH, reasoning, perplexity, retrieval-head knockout.

    python research/reference/eval_reference.py                          # shipped model, full eval (GPU)
    python research/reference/eval_reference.py --quick --device cpu     # short contexts, few samples
    python research/reference/eval_reference.py --model runs/reference --text-only-model runs/textonly
    python research/reference/eval_reference.py --model runs/textonly --ppl-only

A thin caller of the packages: accuracy and perplexity come from ``headscope.evaluate`` (teacher-forced exact
match, the number the targets were set on, and greedy generation beside it), receiver scores from
``headscope.score``, the knockout from ``headscope.knockout.knockout_curve``. Held-out text (the shipped haystack,
or data/corpus/heldout.txt when present) and fresh seeds; NIAH values divisible by 7 were never asked in
training and are reported on their own. Retrieval-head check: knock out (mean-ablate) the top 5% of heads by
NIAH receiver score, and as many random heads (``--random-draws`` draws). Prints a table; --json writes it.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TARGETS = {"niah_mean": 0.95, "niah_min_depth": 0.85, "multikey": 0.80, "reasoning_each": 0.90,
           "knockout_top_drop": 0.50, "knockout_random_drop_max": 0.10}


def heldout_source() -> str:
    """data/corpus/heldout.txt when it exists (the training run's split), else the shipped held-out haystack."""
    path = REPO / "data/corpus/heldout.txt"
    return str(path) if path.exists() else "heldout"


def _acc(df, evaluation: str, metric: str = "accuracy_teacher_forced", **where) -> "object":
    d = df[(df.evaluation == evaluation) & (df.metric == metric) & (df.status == "ok")]
    for k, v in where.items():
        d = d[d[k] == v]
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' (headscope/weights/default) or a folder")
    ap.add_argument("--text-only-model", default=None, help="folder of the text-only model (perplexity reference)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="CPU: context 256, few samples")
    ap.add_argument("--ppl-only", action="store_true")
    ap.add_argument("--context-length", type=int, default=None,
                    help="NIAH prompt tokens (default: training length - 8)")
    ap.add_argument("--n-depth", type=int, default=None, help="NIAH samples per depth")
    ap.add_argument("--n", type=int, default=None, help="samples for multi-key and each reasoning family")
    ap.add_argument("--n-score", type=int, default=None, help="NIAH pairs for receiver scores")
    ap.add_argument("--n-keys", type=int, default=4)
    ap.add_argument("--knockout-frac", type=float, default=0.05)
    ap.add_argument("--knockout-kind", default="mean", choices=["mean", "zero"])
    ap.add_argument("--random-draws", type=int, default=5)
    ap.add_argument("--ppl-windows", type=int, default=None)
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    import headscope
    from headscope.evaluate import training_length
    from headscope.io import write_text
    from headscope.knockout import knockout_curve
    from headscope.reference import load_model

    t_start = time.time()
    model, tok = load_model(a.model, device=a.device)
    train_len = training_length(model)
    ctx = a.context_length or (256 if a.quick else train_len) - 8
    n_depth = a.n_depth or (4 if a.quick else 20)
    n = a.n or (12 if a.quick else 100)
    n_score = a.n_score or (4 if a.quick else 16)
    ppl_window = 256 if a.quick else train_len
    text = heldout_source()
    res: dict = {"model": str(a.model), "context_length": ctx, "device": a.device, "heldout": text}
    ppl_cfg = {"perplexity": {"lengths": (ppl_window,), "n_windows": a.ppl_windows or (8 if a.quick else 64),
                              "text": text}}

    def ppl(m) -> float:
        df = headscope.evaluate(m, "perplexity", tok, configs=ppl_cfg, seed=a.seed, progress=False)
        return float(df[df.metric == "perplexity"].value.iloc[0])

    res["ppl"] = ppl(model)
    if a.text_only_model:
        tmodel, _ = load_model(a.text_only_model, device=a.device)
        res["ppl_text_only"] = ppl(tmodel)
        del tmodel
    if not a.ppl_only:
        df = headscope.evaluate(model, ["niah", "niah_multikey", "reasoning"], tok, seed=a.seed, progress=False,
                                haystack=text if text != "heldout" else None, configs={
                                    "niah": {"lengths": (ctx,), "n": n_depth},
                                    "niah_multikey": {"lengths": (ctx,), "n_keys": (a.n_keys,), "n": n},
                                    "reasoning": {"sizes": (), "n": n}})
        by_depth = _acc(df, "niah").set_index("depth").value
        res["niah_by_depth"] = {float(d): float(v) for d, v in by_depth.items()}
        res["niah_mean"] = float(by_depth.mean())
        res["niah_min_depth"] = float(by_depth.min())
        res["niah_generation_mean"] = float(_acc(df, "niah", "accuracy").value.mean())
        unseen = _acc(df, "niah", "accuracy_unseen_values")
        res["niah_unseen_values"] = {"n": int(unseen.n.sum()) if len(unseen) else 0,
                                     "acc": float(unseen.value.iloc[0]) if len(unseen) else None}
        res["multikey"] = float(_acc(df, "niah_multikey").value.iloc[0])
        res["reasoning"] = {r.family: float(r.value) for r in _acc(df, "reasoning").itertuples()}
        res["reasoning_generation"] = {r.family: float(r.value) for r in _acc(df, "reasoning", "accuracy").itertuples()}

        # retrieval heads: receiver scores (headscope.score), then knockout (headscope.knockout)
        t0 = time.time()
        scores = headscope.score(model, "niah", tokenizer=tok, n_samples=n_score, seed=a.seed * 100 + 70,
                                 progress=False, context_length=ctx, depth="random", haystack="heldout")
        res["score_seconds"] = round(time.time() - t0, 1)
        n_total = scores.n_layers * scores.n_heads
        k = max(1, round(a.knockout_frac * n_total))
        res["top_heads"] = [[h.layer, h.head, round(scores[h], 3)] for h in scores.top(min(10, n_total))]
        curve = knockout_curve(model, task="niah", scores=scores, tokenizer=tok, ks=[0, k], kind=a.knockout_kind,
                               n_random=a.random_draws, n_samples=16 if a.quick else 4 * n_depth,
                               seed=a.seed * 100 + 80, progress=False, context_length=ctx, depth="uniform",
                               haystack="heldout")
        base = float(curve[curve.k == 0].accuracy.iloc[0])
        top_acc = float(curve[(curve.k == k) & (curve.selection == "top")].accuracy.iloc[0])
        rand = curve[(curve.k == k) & (curve.selection == "random")].accuracy.tolist()
        rand_acc = sum(rand) / len(rand) if rand else float("nan")
        res["knockout"] = {"k": k, "kind": a.knockout_kind, "base": base, "top": top_acc, "random_mean": rand_acc,
                           "random_each": rand, "top_drop": base - top_acc, "random_drop": base - rand_acc}
        res["checks"] = {
            "niah_mean>=0.95": res["niah_mean"] >= TARGETS["niah_mean"],
            "niah_every_depth>=0.85": res["niah_min_depth"] >= TARGETS["niah_min_depth"],
            "multikey>=0.80": res["multikey"] >= TARGETS["multikey"],
            "reasoning_each>=0.90": min(res["reasoning"].values()) >= TARGETS["reasoning_each"],
            "knockout_top_drop>=0.50": base - top_acc >= TARGETS["knockout_top_drop"],
            "knockout_random_drop<=0.10": base - rand_acc <= TARGETS["knockout_random_drop_max"],
        }
    res["seconds"] = round(time.time() - t_start, 1)
    print_table(res)
    if a.json:
        write_text(a.json, json.dumps(res, indent=1))


def print_table(res: dict) -> None:
    rows = [("held-out perplexity", f"{res['ppl']:.2f}")]
    if "ppl_text_only" in res:
        rows.append(("held-out perplexity, text-only model", f"{res['ppl_text_only']:.2f}"))
    if "niah_by_depth" in res:
        rows.append((f"NIAH @{res['context_length']} mean / min depth",
                     f"{res['niah_mean']:.3f} / {res['niah_min_depth']:.3f}"))
        rows.append(("NIAH by depth 0.0..1.0", " ".join(f"{v:.2f}" for v in res["niah_by_depth"].values())))
        rows.append(("NIAH mean, greedy generation", f"{res['niah_generation_mean']:.3f}"))
        u = res["niah_unseen_values"]
        rows.append(("NIAH, values never asked in training", f"{u['acc']:.3f} (n={u['n']})" if u["n"] else "n=0"))
        rows.append(("multi-key NIAH", f"{res['multikey']:.3f}"))
        for f, v in res["reasoning"].items():
            rows.append((f"reasoning: {f}", f"{v:.3f}"))
        ko = res["knockout"]
        rows.append((f"knockout ({ko['kind']}) top {ko['k']} heads", f"{ko['base']:.3f} -> {ko['top']:.3f}"))
        rows.append((f"knockout ({ko['kind']}) {ko['k']} random heads x{len(ko['random_each'])}",
                     f"{ko['base']:.3f} -> {ko['random_mean']:.3f}"))
        rows.append(("top heads (layer, head, score)",
                     " ".join(f"L{l}H{h}:{s:.2f}" for l, h, s in res["top_heads"][:5])))
        rows += [(f"check {k}", "PASS" if v else "FAIL") for k, v in res["checks"].items()]
    w = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{w}}  {value}")


if __name__ == "__main__":
    main()
