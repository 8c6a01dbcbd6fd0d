"""How far from the teacher a NoPE FA branch starts: stage 1's alignment loss at conversion, per FA-branch variant.

    python -m research.nope_init                                  # SmolLM2-135M-Instruct, the broad recipe's mask
    python -m research.nope_init --length 2048 --json nope_init.json   # stage 1's length

Each variant is the teacher converted by ``hybrid.from_mask`` with the same mask and seed (so the GDN heads, whose
new parameters are random, start the same in every variant) and only the FA branch set otherwise: RoPE kept (the
teacher's heads exactly), NoPE with the teacher's query rows (``fa_nope_init = "copy"``), and NoPE with the queries
mapped to the teacher's RoPE logit averaged over the causal pairs of a context (``"rope_mean"``, at two context
lengths), each with and without the log-length query scale, and partial RoPE (``fa_rope_max_wavelength``: only the
frequencies whose wavelength is within 8192 or 2048 positions rotated). The number is the loss stage 1 trains on with
``align_inputs = "teacher"`` (``hybrid.train.stages.align_loss``: the sum over layers of the per-position mean
squared error of each layer's output, every layer reading the teacher's input to it), averaged over windows of
held-out text (the fidelity suite's sources, none of them training text), before any training. The difference to
the RoPE variant is what the FA branch's change costs at the start; the GDN heads' share is the same in all.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
MASK = ROOT / "research/train_hybrid/smollm2_broad_mask.json"
VARIANTS = {  # name -> HybridOptions overrides of the FA branch (the gate is the identity at conversion)
    "rope": dict(fa_rope=True, fa_log_scale=False),
    "rope_log": dict(fa_rope=True, fa_log_scale=True),
    "nope_copy": dict(fa_rope=False, fa_log_scale=False),
    "nope_log_copy": dict(fa_rope=False, fa_log_scale=True),
    "nope_rope_mean_2048": dict(fa_rope=False, fa_log_scale=False, fa_nope_init="rope_mean", fa_nope_init_length=2048),
    "nope_log_rope_mean_2048": dict(fa_rope=False, fa_log_scale=True, fa_nope_init="rope_mean",
                                    fa_nope_init_length=2048),
    "nope_log_rope_mean_8192": dict(fa_rope=False, fa_log_scale=True, fa_nope_init="rope_mean",
                                    fa_nope_init_length=8192),
    # partial RoPE: the frequencies that turn within the teacher's 8192 positions (or 2048) rotated, the slower none
    "rope_part_8192": dict(fa_rope=True, fa_log_scale=False, fa_rope_max_wavelength=8192),
    "rope_part_log_8192": dict(fa_rope=True, fa_log_scale=True, fa_rope_max_wavelength=8192),
    "rope_part_log_2048": dict(fa_rope=True, fa_log_scale=True, fa_rope_max_wavelength=2048),
}


def windows(tokenizer, n: int, length: int) -> tuple[torch.Tensor, list[str]]:
    """``n`` windows of ``length`` tokens, one per held-out source of the fidelity suite in its manifest's order
    (``headscope.evaluate.fidelity_data.load_sources``), round again past the last: ([n, length], source names)."""
    from headscope.evaluate.fidelity_data import load_sources

    sources = [(name, tokenizer(text, add_special_tokens=False)["input_ids"]) for name, text in load_sources()]
    out, names = [], []
    for i in range(n):
        name, ids = sources[i % len(sources)]
        start = min(i // len(sources) * length, max(0, len(ids) - length))
        out.append(torch.tensor(ids[start:start + length]))
        names.append(name)
    return torch.stack(out), names  # [n, length]


@torch.no_grad()
def alignment_loss(student, teacher, ids: torch.Tensor) -> float:
    """Stage 1's loss (align_inputs = "teacher") per position, averaged over the rows of ``ids`` [n, T]."""
    from hybrid.train.stages import align_loss

    total = 0.0
    for row in ids:
        (_, _, s, count), = align_loss(SimpleNamespace(align_inputs="teacher"), student, teacher, row[None],
                                       None, contextlib.nullcontext())
        total += float(s) / float(count)
    return total / len(ids)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--mask", default=str(MASK))
    ap.add_argument("--windows", type=int, default=7, help="windows of held-out text (default 7: one per source)")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; give some of {', '.join(VARIANTS)}")
    import hybrid
    from headscope.io import write_text
    from headscope.reference import load_model

    torch.manual_seed(0)
    teacher, tok = load_model(a.model)
    ids, sources = windows(tok, a.windows, a.length)  # [n, T]
    mask = Path(a.mask).resolve()
    shown = str(mask.relative_to(ROOT)) if mask.is_relative_to(ROOT) else a.mask
    res = {"model": a.model, "mask": shown, "windows": a.windows, "length": a.length, "sources": sources, "seed": 0,
           "loss": {}}
    for name in names:
        student = hybrid.from_mask(teacher, a.mask, gdn_fold_heads=True, **VARIANTS[name]).eval()
        res["loss"][name] = alignment_loss(student, teacher, ids)
        print(f"{name:26s} stage-1 loss at conversion {res['loss'][name]:.4f}"
              + (f"  ({res['loss'][name] - res['loss']['rope']:+.4f} vs rope)" if "rope" in res["loss"] else ""),
              flush=True)
    if a.json:
        write_text(a.json, json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
