"""Keyed lookups (binding, multi-key NIAH) on the shipped model, CPU: accuracy by key count and by binding
kind, and where the heads look.

    python research/reference/lookup_attention.py            # ~2 minutes

Accuracy: greedy exact match (headscope.ablation.answer_correct) on held-out prompts, multi-key NIAH with 2 and
4 keys at 256 and 1024 tokens (48 prompts each), binding split into directly bound and copied variables
(160 prompts).

For each prompt, at the position that predicts the answer's first digit, each head's attention is restricted
to the first digits of all values in the prompt (the candidates: a digit after " = " or " is "); the script
reports how often its most-attended candidate is the asked value's, per head (chance: 1 / number of values).
A head that solves the lookup scores near 1; a head that finds "a value" but not the keyed one scores near chance.
"""
from __future__ import annotations

import argparse

import torch


def hit_rates(model, tok, pairs) -> tuple[torch.Tensor, int]:
    """[L, H] fraction of prompts whose argmax-attended value digit is the asked one, and the prompt count."""
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    hits, n = torch.zeros(n_layers, n_heads), 0
    for p in pairs:
        text = p.clean_prompt + p.clean_answer[:1]  # through the answer's leading space: next is the first digit
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offs = enc["input_ids"], enc["offset_mapping"]
        toks = [tok.decode([i]) for i in ids]
        cands = [j for j in range(2, len(ids) - 1)
                 if toks[j].isdigit() and toks[j - 1] == " " and toks[j - 2] in (" =", " is")]
        start = p.changed_spans[0][0]
        asked = [j for j, (a, _) in enumerate(offs) if a == start]
        if not asked or asked[0] not in cands:
            continue
        n += 1
        with torch.no_grad():
            att = model(torch.tensor([ids]), output_attentions=True).attentions  # L x [1, H, T, T]
        for layer, a in enumerate(att):
            best = a[0, :, -1, cands].argmax(-1)  # [H]
            hits[layer] += torch.tensor([cands[int(b)] == asked[0] for b in best], dtype=torch.float)
    return hits / max(n, 1), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--seed", type=int, default=21)
    a = ap.parse_args()
    from headscope.reference import load_model
    from headscope.tasks import get_task

    from headscope.ablation import answer_correct

    torch.set_num_threads(2)
    model, tok = load_model(a.model)
    for ctx in (256, 1024):
        for n_keys in (2, 4):
            tp = get_task("niah_multikey", context_length=ctx, n_keys=n_keys, depth="random",
                          haystack="heldout").tokenized(tok, 48, seed=11)
            print(f"multi-key NIAH, {n_keys} keys, {ctx} tokens: {float(answer_correct(model, tp).float().mean()):.3f}")
    tp = get_task("binding").tokenized(tok, 160, seed=12)
    ok = answer_correct(model, tp).tolist()
    for chained, label in ((False, "bound directly"), (True, "copied (e = b)")):
        sel = [c for c, p in zip(ok, tp) if bool(p.pair.meta.get("chained")) == chained]
        print(f"binding, asked variable {label}: {sum(sel) / len(sel):.3f} of {len(sel)}")
    model.set_attn_implementation("eager")  # attention weights
    for name, cfg, n_values in [("binding", dict(chain=0.0), 4),
                                ("niah_multikey", dict(context_length=256, n_keys=4, haystack="heldout"), 4)]:
        rates, n = hit_rates(model, tok, get_task(name, **cfg).generate(tok, n=a.n, seed=a.seed))
        top = sorted(((float(rates[l, h]), f"L{l}H{h}") for l in range(rates.shape[0]) for h in range(rates.shape[1])),
                     reverse=True)[:5]
        print(f"{name} ({n} prompts, {n_values} values, chance {1 / n_values:.2f}): "
              + ", ".join(f"{h} {r:.2f}" for r, h in top))


if __name__ == "__main__":
    main()
