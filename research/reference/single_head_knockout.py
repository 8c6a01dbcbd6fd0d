"""NIAH accuracy drop when each head alone is mean-ablated: an [L, H] table (CPU, ~3 minutes at 504 tokens).

    python research/reference/single_head_knockout.py                      # the shipped model
    python research/reference/single_head_knockout.py --model path/to/folder

Shows which heads a model cannot lose one at a time: the retrieval heads, and (in stage 1 of the reference
model) infrastructure heads in layer 0 that made random knockouts costly. Same ablation as the eval: the
head's input slice of the output projection replaced by its mean over other NIAH prompts.
"""
from __future__ import annotations

import argparse

import torch


def niah_pairs(tok, ctx: int, depth, n: int, seed: int):
    from headscope.tasks import get_task

    return get_task("niah", context_length=ctx, depth=depth, haystack="heldout").tokenized(tok, n, seed=seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--context-length", type=int, default=504)
    ap.add_argument("--n", type=int, default=40)
    a = ap.parse_args()
    from headscope.ablation import ablate_heads, answer_accuracy, head_means
    from headscope.reference import load_model

    torch.set_num_threads(2)
    model, tok = load_model(a.model)
    pairs = niah_pairs(tok, a.context_length, "uniform", a.n, seed=8080)
    means = head_means(model, [p.clean_ids for p in niah_pairs(tok, a.context_length, "random", 8, seed=9090)])
    base = answer_accuracy(model, pairs, batch_size=8)
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    drop = torch.zeros(L, H)  # [L, H]
    for layer in range(L):
        for head in range(H):
            with ablate_heads(model, [(layer, head)], kind="mean", values=means):
                drop[layer, head] = base - answer_accuracy(model, pairs, batch_size=8)
        print(f"L{layer}: " + " ".join(f"{float(d):5.2f}" for d in drop[layer]), flush=True)
    order = drop.flatten().argsort(descending=True)[:6]
    print(f"base accuracy {base:.3f} ({a.n} prompts, {a.context_length} tokens); largest drops: "
          + ", ".join(f"L{int(i) // H}H{int(i) % H} {float(drop.flatten()[i]):.2f}" for i in order))


if __name__ == "__main__":
    main()
