"""docs/hybrid.md's Python snippets run as written: each ```python block, in order, in a fresh namespace (so each
one carries its own imports), in a scratch folder (they write out/hybrid), with the shipped reference model."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from headscope.reference import has_default_weights

DOC = Path(__file__).resolve().parents[2] / "docs" / "hybrid.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_doc_has_its_snippets():
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 2 and any("from_pretrained" in b for b in blocks)
    for b in blocks:  # every snippet that uses a package imports it itself
        for pkg in ("headscope", "hybrid"):
            if re.search(rf"\b{pkg}\.", b):
                assert re.search(rf"^import {pkg}\b|^import .*\b{pkg}\b", b, flags=re.M), (pkg, b[:80])
        if "AutoModelForCausalLM" in b:
            assert "from transformers import AutoModelForCausalLM" in b


@pytest.mark.skipif(not has_default_weights(), reason="the reference model's weights are not on disk")
def test_hybrid_doc_snippets_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(DOC.read_text())
    spaces = []
    for i, block in enumerate(blocks):
        ns: dict = {"__name__": f"hybrid_md_block_{i}"}
        exec(compile(block, f"docs/hybrid.md python block {i}", "exec"), ns)
        spaces.append(ns)
    assert len(spaces) >= 3, "docs/hybrid.md lost a snippet (build, load, batched decoding)"
    first, second, decoding = spaces[0], spaces[1], spaces[2]
    assert first["greedy"].shape[1] == first["ids"].shape[1] + 8 and first["beams"].shape == first["greedy"].shape
    assert (tmp_path / "out" / "hybrid" / "config.json").exists()
    assert type(second["model"]).__name__ == "HybridForCausalLM" and second["tok"] is not None
    assert tuple(decoding["tokens"].shape) == (2, 8)  # [B, max_new_tokens]
