"""Loops in the saved chat answers of a fidelity run (``chat_answers.jsonl``), for runs made before the suite
reported ``chat_repeated_4grams_*``: re-tokenizes each answer and prints, for teacher and student, the mean share of
repeated token 4-grams (``headscope.evaluate.fidelity.repeated_ngrams``) and how many answers exceed --over; where
the rows hold the suite's per-instruction ``ratio``, also that ratio's mean and median over all instructions and over
the pairs where neither answer exceeds --over (the suite's ``chat_nll_ratio_no_loops``, for runs made before it).

    python -m research.chat_repetition docs/results/2026-12-03_smollm2_broad_hybrid_fidelity_seed0/chat_answers.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("answers", type=Path, help="a chat_answers.jsonl of the fidelity suite")
    ap.add_argument("--tokenizer", default="smollm2-135m", help="headscope.load_model name whose tokenizer to use")
    ap.add_argument("--over", type=float, default=None, help="count answers with more than this share repeated "
                    "(default: the suite's LOOP_SHARE, 0.3)")
    a = ap.parse_args(argv)
    if not a.answers.is_file():
        ap.error(f"{a.answers}: no such file; give the chat_answers.jsonl a fidelity run wrote")

    import headscope
    from headscope.evaluate.fidelity import LOOP_SHARE, repeated_ngrams

    if a.over is None:
        a.over = LOOP_SHARE

    _, tok = headscope.load_model(a.tokenizer)
    rows = [json.loads(line) for line in a.answers.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = {"answers": len(rows)}
    shares = {}
    for who in ("teacher", "student"):
        shares[who] = [repeated_ngrams(tok(r[f"{who}_answer"], add_special_tokens=False)["input_ids"]) for r in rows]
        out[who] = {"mean_repeated_4grams": round(statistics.fmean(shares[who]), 3),
                    f"answers_over_{a.over:g}": sum(s > a.over for s in shares[who])}
    ratios = [(r.get("ratio"), t, s) for r, t, s in zip(rows, shares["teacher"], shares["student"])]
    every = [x for x, _, _ in ratios if x is not None]
    if every:
        calm = [x for x, t, s in ratios if x is not None and t <= a.over and s <= a.over]
        summary = lambda v: ({"n": len(v), "mean": round(statistics.fmean(v), 3),  # noqa: E731
                              "median": round(statistics.median(v), 3)} if v else {"n": 0})
        out["ratio"] = summary(every)
        out["ratio_no_loops"] = summary(calm)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
