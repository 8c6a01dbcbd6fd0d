"""research.perf.tokenize_speed: a corpus's tokenization timed with the tokenizers' threads off and on, per training
source (held-out ones left out), the same tokens either way; unknown sources named."""
from __future__ import annotations

import json

import pytest

from hybrid.train import text
from research.perf import tokenize_speed


def manifest(tmp_path) -> str:
    entries = {}
    for name, split in (("prose", "train"), ("code", "train"), ("held", "heldout")):
        f = tmp_path / "sources" / f"{name}.txt"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text.DOC_SEP.join(f"{name} {i} " * 30 for i in range(20)), encoding="utf-8")
        entries[name] = {"split": split, "file": f"sources/{name}.txt", "weight": 1.0 if split == "train" else None,
                         "tokens": 1, "domain": "test", **({"why": "evaluation only"} if split == "heldout" else {})}
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": text.MANIFEST_SCHEMA, "sources": entries}))
    return str(tmp_path / "manifest.json")


def test_every_training_source_timed_both_ways(tmp_path, capsys):
    out = tokenize_speed.main(["--manifest", manifest(tmp_path), "--model", "default", "--out",
                               str(tmp_path / "t.json")])
    assert [r["source"] for r in out["rows"]] == ["prose", "code"]
    # tiny sources: the seconds may round to 0
    assert all(r["tokens"] > 100 and r["seconds_off"] >= 0 and r["seconds_on"] >= 0 for r in out["rows"])
    assert out["total"]["tokens"] == sum(r["tokens"] for r in out["rows"])
    assert json.loads((tmp_path / "t.json").read_text())["total"] == out["total"]
    assert "total:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tokenize_speed.main(["--manifest", manifest(tmp_path), "--model", "default", "--sources", "nope"])
    assert "nope: not in" in capsys.readouterr().err
