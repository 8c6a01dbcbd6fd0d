"""The text a training mixture's rows read: the pre-tokenized corpus ("heldout" / "train" / a text file), the broad
corpus's weighted sources from its manifest (``TextSources``, ``load_text``: token ids cached on disk beside the
corpus, held-out sources refused by name), the teacher's cached text as one more source, and text sampled from the
teacher itself (``sample_teacher``). ``hybrid.train.data`` builds the batches from them.
"""
from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass

import torch

DOC_SEP = "<|endoftext|>\n"  # between documents in a corpus source file (research.corpus.build writes them)


def tokenize_corpus(tokenizer, text: str, chunk_chars: int = 100_000) -> torch.Tensor:
    """The whole corpus as one long id tensor ``[N]``: ``headscope.tasks.haystack.tokenize_text`` (one tokenizer)."""
    from headscope.tasks.haystack import tokenize_text

    return tokenize_text(tokenizer, text, chunk_chars)  # [N]


_CORPUS_CACHE: dict[tuple, torch.Tensor] = {}


def load_corpus(spec: str, tokenizer) -> torch.Tensor:
    """``spec`` "heldout" / "train" (headscope.tasks.load_haystack) or a text file path -> ids ``[N]``
    (memoised per process for the shipped texts)."""
    from pathlib import Path

    key = (spec, getattr(tokenizer, "name_or_path", id(tokenizer)), len(tokenizer))
    if spec in ("heldout", "train") and key in _CORPUS_CACHE:
        return _CORPUS_CACHE[key]

    if spec in ("heldout", "train"):
        from headscope.tasks import load_haystack

        _CORPUS_CACHE[key] = tokenize_corpus(tokenizer, load_haystack(spec))
        return _CORPUS_CACHE[key]
    else:
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"data.corpus={spec!r}: no such file; give 'heldout', 'train' or a text file "
                                    "(python research/prepare_corpus.py writes data/corpus/train.txt)")
        text = path.read_text(encoding="utf-8")
    return tokenize_corpus(tokenizer, text)


# ---- the broad corpus: weighted text sources ---------------------------------------------------------------
MANIFEST_SCHEMA = "hybrid.corpus_manifest"  # research.corpus.build writes it; load_text reads it
TEACHER_SOURCE = "teacher_corpus"  # the name of the teacher's cached text among the text sources
TEACHER_TEXT = "teacher.txt"  # the text file in a self-distillation folder (research.corpus.self_distill)


class HeldOutSourceError(ValueError):
    """A training mixture names text kept for evaluation (a held-out source, a fidelity file)."""


@dataclass(frozen=True, eq=False)
class TextSources:
    """Named token streams concatenated in ``ids`` (``bounds``: source i is ``ids[bounds[i]:bounds[i+1]]``) and
    the weights that text rows draw them by (normalised to sum 1)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    ids: torch.Tensor  # [N] int32: every source's documents, each ended by the tokenizer's EOS (int32 halves what
    #                    spawned data workers share: tens of millions of tokens)
    bounds: tuple[int, ...]

    @classmethod
    def join(cls, parts: list[tuple[str, float, torch.Tensor]]) -> "TextSources":
        """From ``(name, weight, ids [n])`` parts (weights >= 0, not all 0); zero-weight parts are left out."""
        parts = [p for p in parts if p[1] > 0]
        total = sum(w for _, w, _ in parts)
        if not parts or total <= 0:
            raise ValueError("TextSources: give at least one source with a positive weight")
        bounds = [0]
        for _, _, ids in parts:
            bounds.append(bounds[-1] + len(ids))
        ids = torch.cat([p[2].to(torch.int32) for p in parts])  # [N]
        return cls(tuple(p[0] for p in parts), tuple(w / total for _, w, _ in parts), ids, tuple(bounds))

    def pick(self, rng: random.Random) -> int:
        return rng.choices(range(len(self.names)), weights=self.weights)[0]

    def span(self, i: int) -> tuple[int, int]:
        return self.bounds[i], self.bounds[i + 1]

    def sizes(self) -> dict[str, int]:
        return {n: self.bounds[i + 1] - self.bounds[i] for i, n in enumerate(self.names)}

    def describe(self) -> str:
        return ", ".join(f"{n} {w:.1%} ({k / 1e6:.1f}M tok)" for n, w, k in zip(self.names, self.weights,
                                                                               self.sizes().values()))


def split_long(text: str, chunk_chars: int = 100_000) -> list[str]:
    """``text`` in pieces of about ``chunk_chars`` cut after blank lines (a tokenizer's input stays bounded)."""
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + chunk_chars)
        cut = text.rfind("\n\n", start, end) if end < len(text) else end
        end = cut + 2 if cut > start else end
        pieces.append(text[start:end])
        start = end
    return pieces


def read_documents(path) -> list[str]:
    """The documents of a corpus text file (UTF-8, or xz-compressed ``.xz``), separated by ``DOC_SEP`` lines."""
    import lzma
    from pathlib import Path

    data = Path(path).read_bytes()
    text = (lzma.decompress(data) if str(path).endswith(".xz") else data).decode("utf-8")
    return [d for d in text.split(DOC_SEP) if d.strip()]


def tokenize_documents(tokenizer, docs: list[str], batch_chars: int = 4_000_000) -> torch.Tensor:
    """Documents as one id tensor ``[N]``: each document's ids followed by the tokenizer's EOS (batched calls of
    pieces cut at blank lines)."""
    eos = tokenizer.eos_token_id
    out: list[torch.Tensor] = []
    batch: list[str] = []
    ends: list[bool] = []  # whether the piece ends its document

    def flush() -> None:
        for ids, end in zip(tokenizer(batch, add_special_tokens=False)["input_ids"], ends):
            out.append(torch.tensor(ids + [eos] if end else ids, dtype=torch.int32))  # [n]
        batch.clear()
        ends.clear()

    size = 0
    for d in docs:
        pieces = split_long(d)
        for k, piece in enumerate(pieces):
            batch.append(piece)
            ends.append(k == len(pieces) - 1)
            size += len(piece)
        if size >= batch_chars:
            flush()
            size = 0
    if batch:
        flush()
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int32)  # [N]


_TOKENIZER_KEYS: dict[int, str] = {}


def tokenizer_key(tokenizer) -> str:
    """12 hex digits of the tokenizer's vocabulary and EOS (token caches are valid for that tokenizer only)."""
    import hashlib
    import json

    k = id(tokenizer)
    if k not in _TOKENIZER_KEYS:
        vocab = json.dumps(sorted(tokenizer.get_vocab().items())) + f"|eos={tokenizer.eos_token_id}"
        _TOKENIZER_KEYS[k] = hashlib.sha256(vocab.encode()).hexdigest()[:12]
    return _TOKENIZER_KEYS[k]


_SOURCE_CACHE: dict[tuple, torch.Tensor] = {}


@contextlib.contextmanager
def tokenizer_threads(on: bool = True):
    """The tokenizers library's threads on (or, ``on=False``, off) while inside, whatever ``TOKENIZERS_PARALLELISM``
    says (the study workers and the launcher's steps set it to "false" against forked children; nothing forks here,
    and the DataLoader's workers are spawned after it is restored). Read by the library at each batch call, so this
    is enough: a corpus's first tokenization took ~115 s single-threaded in a study worker on a 16-core GPU machine,
    against ~30 s with threads in a training run."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if on else "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def source_ids(path, tokenizer, cache_dir=None) -> torch.Tensor:
    """The ids ``[N]`` (int32) of a corpus text file (``tokenize_documents``), memoised per process and, with
    ``cache_dir``, on disk as ``<cache_dir>/<file>.<sha12>.<tokenizer12>.pt`` (int32; a folder that is not
    writable is skipped)."""
    from pathlib import Path

    from headscope.io import file_sha256

    path = Path(path)
    digest = file_sha256(path)[:12]
    key = (digest, tokenizer_key(tokenizer))
    if key in _SOURCE_CACHE:
        return _SOURCE_CACHE[key]
    cached = Path(cache_dir) / f"{path.name}.{key[0]}.{key[1]}.pt" if cache_dir else None
    if cached is not None and cached.exists():
        ids = torch.load(cached, weights_only=True).to(torch.int32)  # [N]
    else:
        with tokenizer_threads():
            ids = tokenize_documents(tokenizer, read_documents(path))  # [N] int32
        if cached is not None:
            try:
                from headscope.io import atomic_write

                with atomic_write(cached, "wb") as f:
                    torch.save(ids, f)
            except OSError:
                pass
    _SOURCE_CACHE[key] = ids
    return ids


def read_manifest(path) -> dict:
    """A corpus manifest (``research.corpus.build``), checked."""
    import json
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data.corpus={str(path)!r}: no such corpus manifest; build it with "
                                f"`python -m research.corpus.build --out {p.parent}` (or give 'heldout', 'train' "
                                "or a text file)")
    m = json.loads(p.read_text(encoding="utf-8"))
    if not isinstance(m, dict) or m.get("schema") != MANIFEST_SCHEMA or not isinstance(m.get("sources"), dict):
        raise ValueError(f"data.corpus={str(path)!r} is not a corpus manifest (schema {MANIFEST_SCHEMA!r}); "
                         "give the manifest.json that `python -m research.corpus.build` wrote")
    return m


def manifest_file(manifest_path, entry: dict):
    """A source's text file (the manifest's "file", relative to the manifest; its .xz form when only that one is
    there, or the other way round)."""
    from pathlib import Path

    p = Path(manifest_path).parent / entry["file"]
    alt = Path(str(p)[:-3]) if str(p).endswith(".xz") else Path(str(p) + ".xz")
    if not p.exists() and alt.exists():
        return alt
    if not p.exists():
        raise FileNotFoundError(f"corpus source file {p} (manifest {manifest_path}) is missing; rebuild with "
                                f"`python -m research.corpus.build --out {Path(manifest_path).parent}`")
    return p


def training_weights(manifest: dict, weights: dict[str, float], where: str = "data.sources") -> dict[str, float]:
    """The text sources a training mixture draws and their weights: ``weights`` (default: every training source
    at the manifest's weight). A held-out source is refused by name (the split by source cannot leak), so is an
    unknown one; zero weights are dropped."""
    entries = manifest["sources"]
    train = sorted(n for n, e in entries.items() if e.get("split") == "train")
    if not weights:
        weights = {n: float(entries[n].get("weight", entries[n].get("tokens", 1))) for n in train}
    for name in weights:
        if name not in entries:
            raise ValueError(f"{where}: {name!r} is not a source of the corpus manifest; its training sources: "
                             f"{train}")
        if entries[name].get("split") != "train":
            raise HeldOutSourceError(
                f"{where}: {name!r} is a held-out source (split {entries[name].get('split')!r}: evaluation only, "
                f"{entries[name].get('why', 'kept out of training')}); training on it would leak the evaluation "
                f"text. Remove it from {where}; the training sources are {train}")
    weights = {n: float(w) for n, w in sorted(weights.items()) if w > 0}
    if not weights:
        raise ValueError(f"{where}: every weight is 0; give at least one training source a positive weight")
    return weights


def refuse_evaluation_file(path, where: str) -> None:
    """Refuse a text file of headscope's evaluation folder (headscope/evaluate/data/fidelity) as training text."""
    from pathlib import Path

    import headscope

    fidelity = (Path(headscope.__file__).parent / "evaluate" / "data" / "fidelity").resolve()
    p = Path(path).resolve()
    if p == fidelity or fidelity in p.parents:
        raise HeldOutSourceError(f"{where}={str(path)!r} is an evaluation file ({fidelity}): held-out text is never "
                                 "trained on; give a training corpus (data/corpus/manifest.json, 'train', or "
                                 "another text file)")


def teacher_text_file(spec: str):
    """The text file of ``data.teacher_corpus``: a self-distillation folder (its teacher.txt) or a file."""
    from pathlib import Path

    p = Path(spec)
    f = p / TEACHER_TEXT if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"data.teacher_corpus={spec!r}: no {f}; generate it with `python -m "
                                f"research.corpus.self_distill --out {spec}` (or give the .txt it wrote)")
    return f


def text_key(data) -> tuple:
    """What ``load_text`` depends on in a ``DataConfig`` (the trainer memoises text per key)."""
    teacher = getattr(data, "teacher_corpus", "") or ""
    return (data.corpus, tuple(getattr(data, "sources", ()) or ()), teacher,
            getattr(data, "teacher_corpus_share", 0.0) if teacher else None)


def load_text(data, tokenizer, cache: dict | None = None) -> "torch.Tensor | TextSources":
    """The text rows' corpus of a ``DataConfig``: the ids ``[N]`` of ``data.corpus`` ("heldout" / "train" / a
    text file, as ``load_corpus``), or ``TextSources`` when ``data.corpus`` is a corpus manifest (its training
    sources at ``data.sources``' weights, default the manifest's) or ``data.teacher_corpus`` is set (the
    teacher's cached text as one more source, a ``data.teacher_corpus_share`` of the text rows). Memoised in
    ``cache`` by ``text_key``; source token ids are cached on disk beside the corpus (``tokens/``)."""
    from pathlib import Path

    key = text_key(data)
    if cache is not None and key in cache:
        return cache[key]
    spec = data.corpus
    teacher = getattr(data, "teacher_corpus", "") or ""
    share = float(getattr(data, "teacher_corpus_share", 0.0)) if teacher else 0.0
    parts: list[tuple[str, float, torch.Tensor]] = []
    if spec.endswith(".json"):
        manifest = read_manifest(spec)
        weights = training_weights(manifest, dict(getattr(data, "sources", ()) or ()))
        if share < 1.0:
            total = sum(weights.values())
            cache_dir = Path(spec).parent / "tokens"
            for name, w in weights.items():
                ids = source_ids(manifest_file(spec, manifest["sources"][name]), tokenizer, cache_dir)
                parts.append((name, (1.0 - share) * w / total, ids))
    else:
        if spec not in ("heldout", "train"):
            refuse_evaluation_file(spec, "data.corpus")
        if not teacher:
            out = load_corpus(spec, tokenizer)
            if cache is not None:
                cache[key] = out
            return out
        if share < 1.0:
            parts.append(("corpus", 1.0 - share, load_corpus(spec, tokenizer)))
    if teacher and share > 0:
        refuse_evaluation_file(teacher, "data.teacher_corpus")
        f = teacher_text_file(teacher)
        parts.append((TEACHER_SOURCE, share, source_ids(f, tokenizer, f.parent / "tokens")))
    out = TextSources.join(parts)
    if cache is not None:
        cache[key] = out
    return out


@torch.no_grad()
def sample_teacher(teacher, tokenizer, n_rows: int, length: int, temperature: float, seed: int,
                   batch_size: int = 16) -> torch.Tensor:
    """``n_rows`` sequences of ``length`` tokens sampled from ``teacher`` (from its BOS/EOS token),
    concatenated: ``[n_rows * length]``. Seeded in a forked RNG (the caller's RNG state is untouched)."""
    device = next(teacher.parameters()).device
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    out = []
    was_training = teacher.training
    teacher.eval()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for i in range(0, n_rows, batch_size):
            b = min(batch_size, n_rows - i)
            ids = torch.full((b, 1), start, dtype=torch.long, device=device)  # [b, 1]
            gen = teacher.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                                   top_k=0, top_p=1.0,
                                   max_new_tokens=length, min_new_tokens=length, pad_token_id=start,
                                   eos_token_id=None)  # [b, 1 + length]
            out.append(gen[:, 1:].reshape(-1).cpu())
    teacher.train(was_training)
    return torch.cat(out)  # [n_rows * length]
