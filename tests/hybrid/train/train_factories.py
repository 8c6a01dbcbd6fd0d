"""Tiny training set-ups for hybrid.train tests (import by plain name)."""
from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_teacher(folder: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    import transformers as tf

    torch.manual_seed(seed)
    kw = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=4096,
              tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id)
    cfg = tf.Qwen3Config(**{**kw, **overrides})
    model = tf.Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def save_mask(teacher_dir: Path, path: Path, heads=((0, 1), (1, 2))) -> Path:
    from transformers import AutoConfig

    from headscope.heads import Head
    from headscope.mask import HeadMask

    cfg = AutoConfig.from_pretrained(teacher_dir)
    HeadMask.for_model(cfg, [Head(l, h) for l, h in heads]).to_json(path)
    return Path(path)


def stage(name: str, steps: int = 3, seq_len: int = 64, batch_size: int = 2, lr: float = 3e-3, **kw) -> dict:
    return {"name": name, "steps": steps, "seq_len": seq_len, "batch_size": batch_size, "lr": lr, **kw}


def tiny_config(out: Path, teacher: Path, mask: Path, stages=None, **kw):
    from hybrid.train import TrainConfig

    data = {"corpus": "heldout", "text": 0.5, "niah": 0.25, "reasoning": 0.25, "multikey": 0.0, "copy": 0.0}
    d = {"out": str(out), "teacher": str(teacher), "mask": str(mask), "device": "cpu", "progress": False,
         "eval": "none", "log_every": 1, "data": data, "threads": 1,
         "stages": stages or [stage("align"), stage("distill"), stage("long", seq_len=256, batch_size=1)]}
    d.update(kw)
    return TrainConfig.from_dict(d)


def write_broad_corpus(folder: Path) -> str:
    """A corpus manifest: "prose" (a few documents of 300-1000 words), "code" (many of 20-80), "held" (held out);
    the teacher's text in folder/teacher/teacher.txt. Returns the manifest's path."""
    import json
    import random

    from hybrid.train.text import DOC_SEP, MANIFEST_SCHEMA

    rng = random.Random(0)
    words = ["river", "stone", "light", "table", "north", "quiet", "paper", "green", "seven", "glass"]
    entries = {}
    for name, split, sizes, n in (("prose", "train", (300, 1000), 6), ("code", "train", (20, 80), 80),
                                  ("held", "heldout", (300, 600), 4)):
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(*sizes))) + "\n" for _ in range(n)]
        f = folder / "sources" / f"{name}.txt"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(DOC_SEP.join(docs), encoding="utf-8")
        entries[name] = {"split": split, "file": f"sources/{name}.txt", "weight": 1.0 if split == "train" else None,
                         "tokens": 1, "domain": "test", **({"why": "evaluation only"} if split == "heldout" else {})}
    (folder / "manifest.json").write_text(json.dumps({"schema": MANIFEST_SCHEMA, "sources": entries}))
    teacher = folder / "teacher"
    teacher.mkdir()
    (teacher / "teacher.txt").write_text(DOC_SEP.join(f"answer {i} " * 30 for i in range(40)), encoding="utf-8")
    return str(folder / "manifest.json")


def write_manifest(folder, sources: dict) -> str:
    """A corpus manifest in ``folder`` with {name: (split, weight, [documents])}; returns its path."""
    import json

    from hybrid.train import text

    entries = {}
    for name, (split, weight, docs) in sources.items():
        f = folder / "sources" / f"{name}.txt"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text.DOC_SEP.join(docs), encoding="utf-8")
        entries[name] = {"split": split, "file": f"sources/{name}.txt", "weight": weight, "tokens": 1,
                         "domain": "test", **({"why": "evaluation only"} if split == "heldout" else {})}
    path = folder / "manifest.json"
    path.write_text(json.dumps({"schema": text.MANIFEST_SCHEMA, "sources": entries}))
    return str(path)


def docs_of(word: str, n: int = 30) -> list[str]:
    return [f"{word} {i} " * 20 + "\n" for i in range(n)]
