"""How long the broad corpus's first tokenization takes, with the tokenizers library's threads off (as in a study
worker, where TOKENIZERS_PARALLELISM=false) and on (``hybrid.train.text.tokenizer_threads``, what ``source_ids`` now
uses), side by side in one run on this machine's cores. No disk cache is read or written.

    python -m research.perf.tokenize_speed                       # every training source of data/corpus
    python -m research.perf.tokenize_speed --sources linux_docs,python_manual --repeats 2

Prints one line per source and the totals (seconds, tokens/s, on / off); ``--out`` writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from hybrid.train.text import manifest_file, read_documents, read_manifest, tokenize_documents, tokenizer_threads


def timed(tokenizer, docs: list[str], threads: bool) -> tuple[float, int]:
    """(seconds, tokens) of one tokenization of ``docs`` with the tokenizers' threads on or off."""
    with tokenizer_threads(threads):
        t0 = time.perf_counter()
        ids = tokenize_documents(tokenizer, docs)  # [N]
        return time.perf_counter() - t0, len(ids)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--manifest", type=Path, default=Path("data/corpus/manifest.json"))
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer (headscope.load_model name)")
    ap.add_argument("--sources", default=None, help="comma list (default: every training source)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per source and setting (the fastest kept)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if not a.manifest.is_file():
        ap.error(f"{a.manifest}: no corpus manifest; build it with `python -m research.prepare_corpus` first")
    import headscope

    _, tok = headscope.load_model(a.model)
    manifest = read_manifest(a.manifest)
    names = [n for n, s in manifest["sources"].items() if s.get("split") == "train"]
    if a.sources:
        wanted = [n.strip() for n in a.sources.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(manifest["sources"]))
        if unknown:
            ap.error(f"--sources {', '.join(unknown)}: not in {a.manifest} (it has {', '.join(manifest['sources'])})")
        names = wanted
    rows = []
    for name in names:
        docs = read_documents(manifest_file(a.manifest, manifest["sources"][name]))
        off = min(timed(tok, docs, False) for _ in range(a.repeats))
        on = min(timed(tok, docs, True) for _ in range(a.repeats))
        rows.append({"source": name, "tokens": on[1], "seconds_off": round(off[0], 3), "seconds_on": round(on[0], 3)})
        print(f"{name:22s} {on[1]:>11,} tokens  threads off {off[0]:7.2f} s  on {on[0]:7.2f} s  "
              f"({off[0] / max(on[0], 1e-9):.2f}x)", flush=True)
    tokens = sum(r["tokens"] for r in rows)
    off_s, on_s = sum(r["seconds_off"] for r in rows), sum(r["seconds_on"] for r in rows)
    total = {"sources": len(rows), "tokens": tokens, "seconds_off": round(off_s, 1), "seconds_on": round(on_s, 1),
             "speedup": round(off_s / on_s, 2) if on_s else None, "cores": len(os.sched_getaffinity(0))}
    print(f"total: {tokens:,} tokens in {off_s:.1f} s with threads off, {on_s:.1f} s on ({total['speedup']}x, "
          f"{total['cores']} cores)", flush=True)
    out = {"rows": rows, "total": total}
    if a.out:
        from headscope.io import write_text

        write_text(a.out, json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
