"""research.corpus.self_distill on a tiny teacher: writes its cache, resumes a lost chunk identically, leaves a
finished cache alone, refuses other settings; a chat teacher answers the training instructions."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from hybrid.train.text import read_documents
from research.corpus import self_distill as sd
from research.corpus.prompts import instructions

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = dict(device="cpu", progress=False, log=lambda *a: None)


def test_writes_resumes_and_keeps_its_cache(tiny_teacher_dir, tmp_path, monkeypatch):
    out = tmp_path / "t"
    rec = sd.run(str(tiny_teacher_dir), 6, out, max_new_tokens=6, batch_size=4, **QUIET)
    assert rec["settings"]["mode"] == "seeds" and rec["counts"]["samples"] == 6
    s = json.loads((out / "teacher.json").read_text())["settings"]
    assert (s["temperature"], s["top_p"], s["max_new_tokens"], s["seed"], s["batch_size"]) == (1.0, 0.95, 6, 0, 4)
    assert len(s["model_fingerprint"]) == 16 and s["prompt_set"]
    text = (out / "teacher.txt").read_text()
    assert len(read_documents(out / "teacher.txt")) == 6
    assert rec["counts"]["text_sha256"] == hashlib.sha256((out / "teacher.txt").read_bytes()).hexdigest()
    assert sorted(p.name for p in (out / "parts").iterdir()) == ["part-00000.json", "part-00000.txt",
                                                                 "part-00001.json", "part-00001.txt", "settings.json"]

    # interrupted after chunk 0: chunk 1 is generated again, identically; chunk 0 is kept
    for name in ("parts/part-00001.txt", "parts/part-00001.json", "teacher.txt", "teacher.json"):
        (out / name).unlink()
    kept = (out / "parts" / "part-00000.txt").stat().st_mtime_ns
    sd.run(str(tiny_teacher_dir), 6, out, max_new_tokens=6, batch_size=4, **QUIET)
    assert (out / "teacher.txt").read_text() == text
    assert (out / "parts" / "part-00000.txt").stat().st_mtime_ns == kept

    def no_model(*a, **k):
        raise AssertionError("a finished cache loads no model")

    monkeypatch.setattr("headscope.reference.load_model", no_model)
    assert sd.run(str(tiny_teacher_dir), 6, out, max_new_tokens=6, batch_size=4, **QUIET)["counts"] == rec["counts"]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="other settings.*max_new_tokens"):
        sd.run(str(tiny_teacher_dir), 6, out, max_new_tokens=7, batch_size=4, **QUIET)


def test_chat_teacher_answers_the_instructions(tiny_teacher_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "chat_teacher"
    shutil.copytree(tiny_teacher_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok.save_pretrained(folder)
    rec = sd.run(str(folder), 3, tmp_path / "c", max_new_tokens=4, batch_size=3, **QUIET)
    rows = instructions()
    order = sd.sample_order(3, len(rows), 0)
    assert rec["settings"]["mode"] == "chat" and len(rec["prompts"]) == len(rows)
    for i, doc in enumerate(read_documents(tmp_path / "c" / "teacher.txt")):
        assert doc.startswith(f"<|user|>{rows[order[i]].text}\n<|assistant|>")


def test_sample_order_covers_the_prompts_before_repeating():
    order = sd.sample_order(25, 10, seed=3)
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:20]) == list(range(10))
    assert order == sd.sample_order(25, 10, seed=3) != sd.sample_order(25, 10, seed=4)
    assert sd.sample_order(12, 10, 3) == order[:12]  # a larger n extends, never reorders


def test_static_engine_under_a_one_token_nucleus_is_greedy_generate(tiny_teacher_dir, tmp_path):
    import torch

    from headscope.reference import load_model

    kw = dict(max_new_tokens=5, batch_size=3, top_p=1e-6, **QUIET)  # a nucleus of one token: greedy
    rec = sd.run(str(tiny_teacher_dir), 5, tmp_path / "static", engine="static", **kw)
    assert rec["settings"]["engine"] == "static"
    model, tok = load_model(str(tiny_teacher_dir), dtype=torch.float32, device="cpu")
    prompts = sd.build_prompts(tok)[0]
    want = []
    for i in sd.sample_order(5, len(prompts), 0):  # transformers' greedy generate(), one unpadded prompt at a time
        x = torch.tensor([tok(prompts[i], add_special_tokens=False)["input_ids"]])  # [1, P]
        new = model.generate(x, do_sample=False, max_new_tokens=5, eos_token_id=rec["settings"]["stop_token_ids"],
                             pad_token_id=tok.eos_token_id)[0, x.shape[1]:]
        want.append((prompts[i] + tok.decode(new, skip_special_tokens=False)).rstrip("\n") + "\n")
    assert read_documents(tmp_path / "static" / "teacher.txt") == read_documents_of(want)
    with pytest.raises(ValueError, match="other settings.*engine"):
        sd.run(str(tiny_teacher_dir), 5, tmp_path / "static", engine="hf", **kw)
    with pytest.raises(ValueError, match="engine='fast'"):
        sd.run(str(tiny_teacher_dir), 5, tmp_path / "x", engine="fast", **kw)


def read_documents_of(docs: list[str]) -> list[str]:
    from hybrid.train.text import DOC_SEP

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "t.txt"
        f.write_text(DOC_SEP.join(docs), encoding="utf-8")
        return read_documents(f)


def test_max_minutes_keeps_the_chunks_done(tiny_teacher_dir, tmp_path):
    rec = sd.run(str(tiny_teacher_dir), 6, tmp_path / "t", max_new_tokens=3, batch_size=2, max_minutes=1e-9, **QUIET)
    assert rec["counts"]["samples"] == rec["settings"]["n"] == 2  # the first chunk always runs, then the budget ends
    assert len(read_documents(tmp_path / "t" / "teacher.txt")) == 2
    full = sd.run(str(tiny_teacher_dir), 6, tmp_path / "t", max_new_tokens=3, batch_size=2, **QUIET)
    assert full["counts"]["samples"] == 6 and len(read_documents(tmp_path / "t" / "teacher.txt")) == 6
