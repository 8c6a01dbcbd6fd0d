"""Prompt building (headscope.evaluate.building): spawned workers give the same pairs as this process, never
fork, do not re-run the calling script, and fall back to this process when they cannot be used."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from headscope.evaluate.building import PromptBuilder, build_cells, prompt_builder

from char_tokenizer import char_tokenizer

REPO = Path(__file__).resolve().parents[3]
CELLS = [("niah", {"context_length": 160, "depth": d, "haystack": "heldout"}, 3, 11 + i) for i, d in
         enumerate((0.0, 0.5, 1.0))]
CELLS += [("niah_multikey", {"context_length": 60, "n_keys": 8, "depth": "random", "haystack": "heldout"}, 2, 5)]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, str):
            assert x == y
            continue
        assert len(x) == len(y)
        for p, q in zip(x, y):
            for f in ("clean_ids", "corrupt_ids", "answer_pos", "clean_answer_ids", "corrupt_answer_ids", "diff_pos"):
                assert torch.equal(getattr(p, f), getattr(q, f)), f
            assert p.pair == q.pair and p.first_diff == q.first_diff and p.prompt_len == q.prompt_len


def test_spawned_workers_build_what_this_process_builds(tok):
    here = build_cells(tok, CELLS, workers=0)
    assert isinstance(here[3], str) and "no room" in here[3]  # 8 keyed needles do not fit 60 tokens: the reason
    assert [len(x) for x in here[:3]] == [3, 3, 3]
    with PromptBuilder(tok, workers=2) as builder:
        first = builder.submit(CELLS[:2])
        second = builder.submit(CELLS[2:])  # both in flight at once, the pool started once
        got = first.result() + second.result()
        assert builder._pool.context.get_start_method() == "spawn"  # never fork (the H200 stall)
    _same(here, got)
    assert builder._pool is None  # closed on exit


def test_a_script_without_main_guard_is_not_rerun_by_the_workers(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        print("TOP-LEVEL RAN", flush=True)
        from char_tokenizer import char_tokenizer
        from headscope.evaluate.building import build_cells
        cells = [("niah", {"context_length": 200, "depth": d, "haystack": "heldout"}, 2, 1) for d in (0.0, 1.0)]
        out = build_cells(char_tokenizer(), cells, workers=2)
        print("BUILT", [x if isinstance(x, str) else len(x) for x in out], flush=True)
    """))
    path = os.pathsep.join([str(REPO), str(REPO / "tests" / "headscope")])
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": path})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("TOP-LEVEL RAN") == 1, res.stdout  # the workers did not run the script again
    assert "BUILT [2, 2]" in res.stdout


class _Unpicklable:
    """A tokenizer that cannot be pickled (it holds a lambda): built in this process, with a warning."""

    def __init__(self, tok):
        self._tok, self._fn = tok, lambda x: x

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **k):
        return self._tok(*a, **k)

    def __len__(self):
        return len(self._tok)


def test_unpicklable_tokenizer_builds_here_with_a_warning(tok):
    bad = _Unpicklable(tok)
    with pytest.warns(UserWarning, match="cannot be pickled"):
        builder = PromptBuilder(bad, workers=2)
    with builder:
        assert builder.workers == 0
        got = builder.build(CELLS[:1])
    assert builder._pool is None
    _same(build_cells(tok, CELLS[:1]), got)


def test_broken_pool_falls_back_to_this_process(tok, monkeypatch):
    from concurrent.futures.process import BrokenProcessPool

    with PromptBuilder(tok, workers=2) as builder:
        def broken():
            raise BrokenProcessPool("a worker died")

        monkeypatch.setattr(builder, "_executor", broken)
        with pytest.warns(UserWarning, match="building the prompts in this process"):
            got = builder.build(CELLS[:2])
        assert builder.workers == 0
    _same(build_cells(tok, CELLS[:2]), got)


def test_prompt_builder_shares_the_active_builder(tok):
    with prompt_builder(tok, 0, activate=True) as outer:
        with prompt_builder(tok, 0) as inner:
            assert inner is outer
        with prompt_builder(char_tokenizer(), 0) as other:  # another tokenizer: its own builder
            assert other is not outer
    with prompt_builder(tok, 0) as fresh:
        assert fresh is not outer


def test_bad_worker_count():
    with pytest.raises(ValueError, match="workers=-1"):
        PromptBuilder(None, workers=-1)


STUCK_CELLS = [("niah", {"context_length": 200, "depth": d, "haystack": "heldout"}, 1, 0) for d in (0.0, 1.0)]


def test_stuck_workers_time_out_and_are_ended(tok, monkeypatch):
    from concurrent.futures import TimeoutError

    # workers that never deliver (asleep before their first part; a FIFO haystack was used before, but
    # load_haystack refuses a non-regular file at once, so a fast worker failed instead of hanging)
    monkeypatch.setattr(PromptBuilder, "worker_start_delay", 600.0)
    builder = PromptBuilder(tok, workers=2, share=False)  # only the workers build: both are stuck
    job = builder.submit(STUCK_CELLS)
    with pytest.raises(TimeoutError):
        job.result(timeout=1.0)
    procs = list(builder._pool.procs)
    t0 = time.monotonic()
    builder.close()  # does not wait for the stuck workers: it ends them
    for p in procs:
        p.join(20)
        assert not p.is_alive()
    assert time.monotonic() - t0 < 20


def test_evaluate_with_stuck_workers_ends_within_its_budget(tok, monkeypatch):
    import headscope
    from model_factories import tiny_model

    monkeypatch.setattr(PromptBuilder, "share_work", False)  # only the workers build
    monkeypatch.setattr(PromptBuilder, "worker_start_delay", 600.0)  # and they never deliver

    cfg = {"niah": {"lengths": (200,), "depths": (0.0, 1.0), "n": 1}}
    t0 = time.monotonic()
    df = headscope.evaluate(tiny_model("qwen3"), "niah", tok, configs=cfg, workers=2, budget_s=2, progress=False)
    assert time.monotonic() - t0 < 30
    assert (df.status == "skipped").all() and df.note.str.startswith("budget:").all() and len(df) == 4


# work sharing: this process builds queued parts while it waits, so slow worker start-ups cost no waiting


def test_prompts_are_the_same_whichever_process_builds_them(tok, monkeypatch):
    here = build_cells(tok, CELLS, workers=0)
    with PromptBuilder(tok, workers=2, share=False) as builder:  # the workers build every part
        by_workers = builder.build(CELLS)
        assert builder.built_here == 0
    monkeypatch.setattr(PromptBuilder, "worker_start_delay", 120.0)  # workers asleep: this process builds all
    with PromptBuilder(tok, workers=2) as builder:
        first, second = builder.submit(CELLS[:2]), builder.submit(CELLS[2:])
        by_main = second.result() and first.result() + second.result()  # the later job first: parts of both
        n_parts = sum(min(n, 2) for *_, n, _ in CELLS)  # 2 workers: about 2 parts per cell here
        assert builder.built_here == n_parts
    _same(here, by_workers)
    _same(here, by_main)


def test_a_slow_worker_start_does_not_delay_the_prompts(tok, monkeypatch):
    monkeypatch.setattr(PromptBuilder, "worker_start_delay", 120.0)  # stands for 15 workers importing torch
    t0 = time.monotonic()
    with PromptBuilder(tok, workers=2) as builder:
        got = builder.submit(CELLS).result(timeout=60)
        waited = time.monotonic() - t0
        procs = list(builder._pool.procs)
    closed = time.monotonic() - t0 - waited
    assert waited < 20, waited  # built here (a fraction of a second of work), not after the 120 s start-up
    assert closed < 10, closed  # the sleeping workers are ended, not waited for
    assert all(not p.is_alive() for p in procs)
    _same(build_cells(tok, CELLS), got)


def test_evaluate_with_slow_workers_scores_everything_in_time(tok, monkeypatch):
    import headscope
    from model_factories import tiny_model

    monkeypatch.setattr(PromptBuilder, "worker_start_delay", 120.0)
    cfg = {"niah": {"lengths": (160, 240), "depths": (0.0, 0.5, 1.0), "n": 2}}
    t0 = time.monotonic()
    df = headscope.evaluate(tiny_model("qwen3"), "niah", tok, configs=cfg, workers=2, budget_s=60, progress=False)
    assert time.monotonic() - t0 < 40
    assert (df.status == "ok").all() and set(df.context_length) == {160, 240}


def test_a_part_that_fails_in_a_worker_raises_here(tok):
    bad = [("niah", {"context_length": 160, "depth": 0.5, "haystack": "heldout", "no_such_field": 1}, 2, 0)]
    with pytest.raises(Exception) as here:
        build_cells(tok, bad, workers=0)
    with PromptBuilder(tok, workers=2, share=False) as builder:
        with pytest.raises(type(here.value)):
            builder.build(bad)  # the worker's failure is built again in this process, and raised as without workers


def test_the_worker_module_imports_neither_the_evaluation_package_nor_pandas():
    code = ("import sys, headscope._prompt_worker, headscope.tasks; "
            "print(sorted(m for m in ('headscope.evaluate', 'pandas', 'plotly') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]", res.stdout  # what a spawned worker imports before its first part
