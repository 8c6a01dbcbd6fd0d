"""Evaluate the reference model: NIAH by depth, multi-key NIAH, reasoning, perplexity, retrieval-head knockout.

    python experiments/reference/eval_reference.py                          # shipped model, full eval (GPU)
    python experiments/reference/eval_reference.py --quick --device cpu     # short contexts, few samples
    python experiments/reference/eval_reference.py --model runs/reference --text-only-model runs/textonly
    python experiments/reference/eval_reference.py --model runs/textonly --ppl-only

Everything is on held-out text (the shipped haystack / data/corpus/heldout.txt) with fresh seeds;
NIAH values divisible by 7 were never asked in training and are also reported on their own.
Accuracy is greedy exact match via teacher forcing (headscope.ablation.answer_accuracy).
Retrieval-head check: knock out (mean-ablate) the top 5% of heads by NIAH receiver score, and as many
random other heads (mean of 5 draws). Prints a table and writes JSON (--json).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from hybrid.train.data import is_heldout_value

REPO = Path(__file__).resolve().parents[2]
REASONING_FAMILIES = ("arithmetic", "binding", "comparison", "two_hop")
TARGETS = {"niah_mean": 0.95, "niah_min_depth": 0.85, "multikey": 0.80, "reasoning_each": 0.90,
           "knockout_top_drop": 0.50, "knockout_random_drop_max": 0.10}


# ----------------------------------------------------------------------------- receiver scores

def _metric(logits: torch.Tensor, tp) -> torch.Tensor:
    """Mean over answer tokens of logit[clean] - logit[corrupt]; ``logits  # [B, A, V]`` -> ``[B]``."""
    a = torch.arange(logits.shape[1], device=logits.device)  # [A]
    clean = tp.clean_answer_ids.to(logits.device)  # [A]
    corrupt = tp.corrupt_answer_ids.to(logits.device)  # [A]
    return (logits[:, a, clean] - logits[:, a, corrupt]).float().mean(-1)  # [B]


@torch.no_grad()
def naive_receiver_scores(model, pairs, head_batch: int = 16):
    """Receiver scores by activation patching, one clean forward per head (batched over heads).

    For each head h: the clean run with h's output slice replaced by its value on the corrupted prompt.
    score = (M_clean - M_patched) / (M_clean - M_corrupt). Returns ``HeadScores`` (task "niah").
    """
    from headscope.arch import describe
    from headscope.results import HeadScores

    arch = describe(model)
    L, H = arch.n_layers, arch.n_heads
    heads = [(l, h) for l in range(L) for h in range(H)]
    device = next(model.parameters()).device
    per_sample = torch.zeros(len(pairs), L, H, dtype=torch.float64)  # [N, L, H]
    m_clean_all, m_corr_all = [], []
    for n, tp in enumerate(pairs):
        T, A = tp.clean_ids.shape[0], tp.answer_pos.shape[0]
        assert int(tp.answer_pos[0]) == T - A, "answer positions must be the last A positions"
        z_corr: list[torch.Tensor] = [None] * L  # each [1, T, H*D]
        handles = []
        try:
            for l, proj in enumerate(arch.out_projs):
                handles.append(proj.register_forward_pre_hook(
                    lambda mod, args, l=l: z_corr.__setitem__(l, args[0].detach().clone())))
            corr_logits = model(input_ids=tp.corrupt_ids[None].to(device), logits_to_keep=A).logits  # [1, A, V]
        finally:
            for hd in handles:
                hd.remove()
        clean_logits = model(input_ids=tp.clean_ids[None].to(device), logits_to_keep=A).logits  # [1, A, V]
        m_clean, m_corr = float(_metric(clean_logits, tp)), float(_metric(corr_logits, tp))
        m_clean_all.append(m_clean)
        m_corr_all.append(m_corr)
        for start in range(0, len(heads), head_batch):
            chunk = heads[start:start + head_batch]
            box = {}

            def make_hook(layer):
                def hook(mod, args):
                    z = args[0].clone()  # [B, T, H*D]
                    for b, (l, h) in enumerate(chunk):
                        if l == layer:
                            sl = arch.head_slice(h)
                            z[b, :, sl] = z_corr[l][0, :, sl]
                    return (z,) + tuple(args[1:])
                return hook

            layers = sorted({l for l, _ in chunk})
            handles = []
            try:
                for l in layers:
                    handles.append(arch.out_projs[l].register_forward_pre_hook(make_hook(l)))
                ids = tp.clean_ids[None].expand(len(chunk), T).to(device)  # [B, T]
                m_patched = _metric(model(input_ids=ids, logits_to_keep=A).logits, tp)  # [B]
            finally:
                for hd in handles:
                    hd.remove()
            denom = m_clean - m_corr
            for b, (l, h) in enumerate(chunk):
                per_sample[n, l, h] = (m_clean - float(m_patched[b])) / denom if abs(denom) > 1e-6 else 0.0
    return HeadScores(task="niah", per_sample_raw=per_sample, kind="receiver", n_kv_heads=arch.n_kv_heads,
                      clean_metric=torch.tensor(m_clean_all), corrupt_metric=torch.tensor(m_corr_all),
                      settings={"engine": "naive", "n_samples": len(pairs)})


def receiver_scores(model, tokenizer, pairs, engine: str = "auto"):
    """headscope.api.score (engine="auto") when it is importable, else the naive loop above."""
    if engine == "auto":
        try:
            from headscope.api import score
        except ImportError as err:  # the engine is optional here
            print(f"[scores] headscope.api.score unavailable ({err}); using the naive loop", file=sys.stderr)
        else:
            return score(model, list(pairs), tokenizer=tokenizer, n_samples=len(pairs), progress=False)
    return naive_receiver_scores(model, pairs)


# ----------------------------------------------------------------------------- pieces

def niah_pairs(tok, ctx: int, depth, n: int, seed: int, multikey: bool = False, n_keys: int = 4):
    from headscope.tasks import get_task

    if multikey:
        task = get_task("niah_multikey", context_length=ctx, depth="random", haystack="heldout", n_keys=n_keys)
    else:
        task = get_task("niah", context_length=ctx, depth=depth, haystack="heldout")
    return task.tokenized(tok, n, seed=seed)


@torch.no_grad()
def perplexity(model, tok, text: str, window: int, max_windows: int) -> float:
    from hybrid.train.data import tokenize_corpus

    ids = tokenize_corpus(tok, text)  # [N]
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    n_win = min(max_windows, (len(ids) - 1) // window)
    for i in range(n_win):
        x = ids[i * window:(i + 1) * window + 1].to(device)  # [T+1]
        logits = model(input_ids=x[None, :-1]).logits[0].float()  # [T, V]
        nll += float(torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum"))
        count += window
    return math.exp(nll / max(1, count))


def heldout_text() -> str:
    path = REPO / "data/corpus/heldout.txt"
    if path.exists():
        return path.read_text(encoding="utf-8")
    from headscope.tasks import load_haystack

    return load_haystack("heldout")


# ----------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' (headscope/weights/default) or a folder")
    ap.add_argument("--text-only-model", default=None, help="folder of the text-only model (perplexity reference)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="CPU: context 256, few samples")
    ap.add_argument("--ppl-only", action="store_true")
    ap.add_argument("--context-length", type=int, default=None, help="NIAH prompt tokens (default: training length - 8)")
    ap.add_argument("--n-depth", type=int, default=None, help="NIAH samples per depth")
    ap.add_argument("--n", type=int, default=None, help="samples for multi-key and each reasoning family")
    ap.add_argument("--n-score", type=int, default=None, help="NIAH pairs for receiver scores")
    ap.add_argument("--n-keys", type=int, default=4)
    ap.add_argument("--knockout-frac", type=float, default=0.05)
    ap.add_argument("--knockout-kind", default="mean", choices=["mean", "zero"])
    ap.add_argument("--random-draws", type=int, default=5)
    ap.add_argument("--ppl-windows", type=int, default=None)
    ap.add_argument("--engine", default="auto", choices=["auto", "naive"])
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    from headscope.ablation import ablate_heads, answer_accuracy, answer_correct, head_means
    from headscope.reference import load_model

    t_start = time.time()
    model, tok = load_model(a.model, device=a.device)
    train_len = int(model.config.max_position_embeddings)
    ctx = a.context_length or (256 if a.quick else train_len) - 8
    n_depth = a.n_depth or (4 if a.quick else 20)
    n = a.n or (12 if a.quick else 100)
    n_score = a.n_score or (4 if a.quick else 16)
    ppl_windows = a.ppl_windows or (8 if a.quick else 64)
    ppl_window = 256 if a.quick else train_len
    res: dict = {"model": str(a.model), "context_length": ctx, "device": a.device}
    bs = 8 if a.device == "cpu" else 32

    text = heldout_text()
    res["ppl"] = perplexity(model, tok, text, ppl_window, ppl_windows)
    if a.text_only_model:
        tmodel, _ = load_model(a.text_only_model, device=a.device)
        res["ppl_text_only"] = perplexity(tmodel, tok, text, ppl_window, ppl_windows)
        del tmodel
    if not a.ppl_only:
        depths = [round(0.1 * i, 1) for i in range(11)]
        by_depth, unseen = {}, []
        for i, d in enumerate(depths):
            pairs = niah_pairs(tok, ctx, d, n_depth, seed=a.seed * 100 + i)
            ok = answer_correct(model, pairs, batch_size=bs)
            by_depth[d] = float(ok.float().mean())
            unseen += [bool(c) for c, p in zip(ok, pairs) if is_heldout_value(p.pair.clean_answer)]
            print(f"niah depth {d:.1f}: {by_depth[d]:.3f}", flush=True)
        res["niah_by_depth"] = by_depth
        res["niah_mean"] = sum(by_depth.values()) / len(by_depth)
        res["niah_min_depth"] = min(by_depth.values())
        res["niah_unseen_values"] = {"n": len(unseen), "acc": sum(unseen) / len(unseen) if unseen else None}
        mk = niah_pairs(tok, ctx, None, n, seed=a.seed * 100 + 50, multikey=True, n_keys=a.n_keys)
        res["multikey"] = answer_accuracy(model, mk, batch_size=bs)
        from headscope.tasks import get_task

        res["reasoning"] = {f: answer_accuracy(model, get_task(f).tokenized(tok, n, seed=a.seed * 100 + 60 + j),
                                               batch_size=bs) for j, f in enumerate(REASONING_FAMILIES)}
        print(f"multikey {res['multikey']:.3f}; reasoning {res['reasoning']}", flush=True)

        # retrieval heads: receiver scores, then knockout
        t0 = time.time()
        score_pairs = niah_pairs(tok, ctx, "random", n_score, seed=a.seed * 100 + 70)
        scores = receiver_scores(model, tok, score_pairs, a.engine)
        res["score_seconds"] = round(time.time() - t0, 1)
        n_total = scores.n_layers * scores.n_heads
        k = max(1, round(a.knockout_frac * n_total))
        top = scores.top(k)
        res["top_heads"] = [[h.layer, h.head, round(scores[h], 3)] for h in scores.top(min(10, n_total))]
        ko_pairs = niah_pairs(tok, ctx, "uniform", 4 * n_depth if not a.quick else 16, seed=a.seed * 100 + 80)
        means = head_means(model, [p.clean_ids for p in niah_pairs(tok, ctx, "random", 8, seed=a.seed * 100 + 90)])
        vals = means if a.knockout_kind == "mean" else None
        base = answer_accuracy(model, ko_pairs, batch_size=bs)
        with ablate_heads(model, top, kind=a.knockout_kind, values=vals):
            top_acc = answer_accuracy(model, ko_pairs, batch_size=bs)
        rng = random.Random(a.seed)
        others = [h for h in scores.ranking() if h not in set(top)]
        rand_accs = []
        for _ in range(a.random_draws):
            with ablate_heads(model, rng.sample(others, k), kind=a.knockout_kind, values=vals):
                rand_accs.append(answer_accuracy(model, ko_pairs, batch_size=bs))
        rand_acc = sum(rand_accs) / len(rand_accs)
        res["knockout"] = {"k": k, "kind": a.knockout_kind, "base": base, "top": top_acc, "random_mean": rand_acc,
                           "random_each": rand_accs, "top_drop": base - top_acc, "random_drop": base - rand_acc}
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
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1))


def print_table(res: dict) -> None:
    rows = [("held-out perplexity", f"{res['ppl']:.2f}")]
    if "ppl_text_only" in res:
        rows.append(("held-out perplexity, text-only model", f"{res['ppl_text_only']:.2f}"))
    if "niah_by_depth" in res:
        rows.append((f"NIAH @{res['context_length']} mean / min depth",
                     f"{res['niah_mean']:.3f} / {res['niah_min_depth']:.3f}"))
        rows.append(("NIAH by depth 0.0..1.0", " ".join(f"{v:.2f}" for v in res["niah_by_depth"].values())))
        u = res["niah_unseen_values"]
        rows.append(("NIAH, values never asked in training", f"{u['acc']:.3f} (n={u['n']})" if u["n"] else "n=0"))
        rows.append(("multi-key NIAH", f"{res['multikey']:.3f}"))
        for f, v in res["reasoning"].items():
            rows.append((f"reasoning: {f}", f"{v:.3f}"))
        ko = res["knockout"]
        rows.append((f"knockout ({ko['kind']}) top {ko['k']} heads", f"{ko['base']:.3f} -> {ko['top']:.3f}"))
        rows.append((f"knockout ({ko['kind']}) {ko['k']} random heads x{len(ko['random_each'])}",
                     f"{ko['base']:.3f} -> {ko['random_mean']:.3f}"))
        rows.append(("top heads (layer, head, score)", " ".join(f"L{l}H{h}:{s:.2f}" for l, h, s in res["top_heads"][:5])))
        rows += [(f"check {k}", "PASS" if v else "FAIL") for k, v in res["checks"].items()]
    w = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{w}}  {value}")


if __name__ == "__main__":
    main()
