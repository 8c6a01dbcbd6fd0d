"""research/perf/kernel_sweep.py on the CPU (a stand-in kernel): a row per tuning with its time, bandwidth share and
error; a tuning that raises is recorded and the sweep goes on; tunings past the deadline are counted, not timed;
the fastest and the default row; the JSON rewritten after every cell."""
import json
import time

import torch

from research.perf.kernel_sweep import pick, run_cells, time_tunings


def test_tunings_are_timed_errors_recorded_and_the_deadline_kept():
    x = torch.ones(64)  # [64]

    def call(t):
        if t["s"] == 0:
            raise RuntimeError("out of resources: shared memory\nmore")
        return x * t["s"]

    tunings = [dict(s=1), dict(s=0), dict(s=2)]
    rows, skipped = time_tunings(call, tunings, ref=x, nbytes=256, bandwidth=1e9, deadline=time.monotonic() + 60,
                                 device="cpu")
    assert skipped == 0 and [r["s"] for r in rows] == [1, 0, 2]
    assert rows[0]["max_abs_err"] == 0.0 and rows[2]["max_abs_err"] == 1.0
    assert rows[1]["error"] == "RuntimeError: out of resources: shared memory"
    for r in (rows[0], rows[2]):  # 256 bytes in r["ms"] (rounded) against 1 GB/s
        assert r["ms"] > 0 and r["of_bandwidth"] == round(r["of_bandwidth"], 3) > 0
        assert abs(r["of_bandwidth"] - 256 / r["ms"] / 1e6) <= 0.05 * r["of_bandwidth"] + 1e-3
    best, default = pick(rows, dict(s=2))
    assert default is rows[2] and best in (rows[0], rows[2])
    late, skipped = time_tunings(call, tunings, x, 256, 1e9, deadline=time.monotonic() - 1, device="cpu")
    assert late == [] and skipped == 3
    assert pick(late, dict(s=1)) == (None, None)


def test_run_cells_writes_the_whole_result_after_each_cell_and_gives_each_its_share_of_the_budget(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    seen = []
    t0 = time.monotonic()

    def run_cell(a, b, deadline):
        if seen:  # the first cell is on disk before the second runs
            assert json.loads(out.read_text())["cells"] == [{"a": 1, "b": 2}]
        seen.append(deadline - t0)
        return {"a": a, "b": b}

    res = run_cells([(1, 2), (3, 4)], run_cell, out, {"gpu": "none"}, lambda c: f"cell {c['a']}", budget_s=100.0)
    assert res == {"gpu": "none", "cells": [{"a": 1, "b": 2}, {"a": 3, "b": 4}]}
    assert json.loads(out.read_text()) == res
    assert capsys.readouterr().out.splitlines() == ["cell 1", "cell 3", f"wrote {out}"]
    assert 49 < seen[0] < 51 and 99 < seen[1] < 101  # half of the budget each, what the first left to the second


def test_sweep_prints_a_dry_run_and_refuses_a_machine_without_cuda(capsys, monkeypatch):
    import argparse

    import pytest

    from research.perf.kernel_sweep import sweep

    args = argparse.Namespace(dry_run=True, out=None, bandwidth=1e12, budget_s=1.0)
    todo, tunings = [(1, 2)], [dict(s=1)]
    res = sweep("x_sweep", args, todo, tunings, lambda a, b: f"cell {a}/{b}", lambda t: f"s {t['s']}", None, None)
    assert res == dict(cells=todo, tunings=tunings)
    assert capsys.readouterr().out.splitlines() == ["1 cells x 1 tunings", "  cell 1/2", "  s 1"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="x_sweep: needs a CUDA GPU"):
        sweep("x_sweep", argparse.Namespace(**{**vars(args), "dry_run": False}), todo, tunings, str, str, None, None)
