"""research/stage_prepare.py: a fresh checkout's steps before a GPU lease, in order, each skipped once done."""
from __future__ import annotations

import subprocess

import pytest

from research import stage
from research.stage_prepare import missing_wheels, prepare


def _fake(calls):
    def run(cmd, cwd=None):
        calls.append(cmd[1:3] if cmd[1] == "-m" else cmd)
        return subprocess.CompletedProcess(cmd, 0)
    return run


def test_a_fresh_checkout_runs_every_step_in_order(tmp_path):
    calls = []
    done = prepare(tmp_path, split=lambda m: calls.append(["split", m]), split_corpus=lambda: calls.append(["corpus"]),
                   run=_fake(calls), say=lambda s: None)
    assert calls[0] == ["-m", "pip"] and calls[1:] == [["-m", "research.prepare_corpus"],
                                                       ["-m", "research.corpus.build"], ["split", "smollm2-135m"],
                                                       ["corpus"]]
    assert len(done) == 5


def test_steps_whose_output_is_there_are_skipped(tmp_path):
    for name in ("fla_core-0.6.0-py3-none-any.whl", "gguf-0.19.0-py3-none-any.whl", "plotly-7.1.0-py3-none-any.whl"):
        (tmp_path / ".whl").mkdir(exist_ok=True)
        (tmp_path / ".whl" / name).write_bytes(b"")
    (tmp_path / "data/gz").mkdir(parents=True)
    (tmp_path / "data/corpus").mkdir(parents=True)
    (tmp_path / "data/corpus/manifest.json").write_text("{}")
    (tmp_path / ".stage").mkdir()
    (tmp_path / ".stage/corpus.tar.xz.part1of1").write_bytes(b"")
    calls, said = [], []
    done = prepare(tmp_path, split=lambda m: calls.append(["split", m]), split_corpus=lambda: calls.append(["corpus"]),
                   run=_fake(calls), say=said.append)
    assert calls == [["split", "smollm2-135m"]] and done == ["smollm2-135m's GGUF in parts (.stage/)"]
    assert sum("already there" in s for s in said) == 4


def test_missing_wheels_are_the_pins_without_a_file():
    from pathlib import Path

    assert missing_wheels(Path("/nonexistent")) == ["fla-core==0.6.0", "gguf==0.19.0", "plotly==7.1.0"]


def test_a_failed_step_stops_with_the_fix(tmp_path, monkeypatch, capsys):
    def fail(cmd, cwd=None):
        return subprocess.CompletedProcess(cmd, 100)

    with pytest.raises(RuntimeError, match="run `python -m research.stage prepare` again"):
        prepare(tmp_path, split=lambda m: None, split_corpus=lambda: None, run=fail, say=lambda s: None)
    monkeypatch.setattr(subprocess, "run", fail)
    monkeypatch.setattr(stage, "REPO", tmp_path)
    assert stage.main(["prepare"]) == 1
    assert "research.stage: error: prepare:" in capsys.readouterr().err


def test_the_pins_are_the_ones_docs_research_md_downloads():
    from pathlib import Path

    from research.stage_prepare import WHEEL_PINS

    line = next(ln for ln in (Path(__file__).resolve().parents[2] / "docs/research.md").read_text().splitlines()
                if "pip download" in ln and "fla-core" in ln)
    assert all(pin in line for pin in WHEEL_PINS)
