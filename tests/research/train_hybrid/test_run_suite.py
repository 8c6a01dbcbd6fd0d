"""research/train_hybrid/run.py's run_suite: each evaluation of the suite saved as soon as it is done; after a call
cut short the finished ones are read back (not run again), parts of another model are dropped; the rows and the
chat answers end in OUT/<suite>/."""
from __future__ import annotations

import pandas as pd
import pytest

from headscope.evaluate.output import read_results

pytestmark = pytest.mark.usefixtures("one_thread")


def test_run_suite_keeps_finished_evaluations(tmp_path, monkeypatch):
    import headscope.evaluate as ev
    from headscope.reference import load_model
    from research.train_hybrid.run import run_suite

    model, tok = load_model("default")
    calls = []
    real = ev.evaluate

    def counting(m, names, *a, **k):
        calls.append(tuple(names))
        return real(m, names, *a, **k)

    monkeypatch.setattr(ev, "evaluate", counting)
    rows = run_suite(model, tok, model, "fidelity_smoke", tmp_path, model_key="k1")
    names = ["fidelity_text", "fidelity_continuation", "fidelity_chat", "fidelity_niah"]
    # fidelity_niah's two lengths run (and are saved) one at a time
    assert [c[0] for c in calls] == names + ["fidelity_niah"] and set(rows["evaluation"]) == set(names)
    parts = sorted(p.name for p in (tmp_path / "fidelity_smoke_parts").iterdir() if p.is_dir())
    assert parts == sorted(names[:3] + ["fidelity_niah_1016", "fidelity_niah_4088"])
    assert set(read_results(tmp_path / "fidelity_smoke")["evaluation"]) == set(names)
    side = sorted(p.name for p in (tmp_path / "fidelity_smoke_parts").glob("*/*.jsonl"))
    assert side == sorted(p.name for p in (tmp_path / "fidelity_smoke").glob("*.jsonl"))  # (no chat template here:
    #                                                                  the reference model's chat rows are skipped)
    ok = rows[(rows["status"] == "ok") & (rows["metric"] == "top1_agreement")]
    assert len(ok) and (ok["value"] == 1).all()  # the model against itself

    # a call cut short during the last length of the last evaluation: everything else is read back
    import shutil

    shutil.rmtree(tmp_path / "fidelity_smoke_parts" / "fidelity_niah_4088")
    calls.clear()
    again = run_suite(model, tok, model, "fidelity_smoke", tmp_path, model_key="k1")
    assert calls == [("fidelity_niah",)] and len(again) == len(rows)
    cols = ["evaluation", "metric", "family", "context_length", "value", "n", "status"]

    def same(df):  # read back from the CSV: a missing value is NaN, not None
        return df[cols].assign(value=pd.to_numeric(df["value"]))

    pd.testing.assert_frame_equal(same(again), same(rows), check_dtype=False)

    # an evaluation saved whole (as earlier versions of run_suite did) is read back, not run again by length
    from headscope.evaluate import save_results

    parts = tmp_path / "fidelity_smoke_parts"
    niah = pd.concat([read_results(parts / f"fidelity_niah_{L}") for L in (1016, 4088)], ignore_index=True)
    save_results(niah, parts / "fidelity_niah", overwrite=True, figures=False)
    for L in (1016, 4088):
        shutil.rmtree(parts / f"fidelity_niah_{L}")
    calls.clear()
    assert len(run_suite(model, tok, model, "fidelity_smoke", tmp_path, model_key="k1")) == len(rows)
    assert calls == []

    # another model's parts are not reused
    calls.clear()
    run_suite(model, tok, model, "fidelity_smoke", tmp_path, model_key="k2")
    assert [c[0] for c in calls] == names + ["fidelity_niah"]


def test_split_by_length_gives_the_whole_evaluations_rows(tmp_path):
    """NIAH lengths run one at a time give the rows of the evaluation run whole (each length's prompts are seeded
    by the length alone), so a suite saved length by length is the same suite."""
    import headscope.evaluate as ev
    from headscope.evaluate.api import resolve_suite
    from headscope.reference import load_model
    from research.train_hybrid.run import split_by_length

    model, tok = load_model("default")
    over = dict(resolve_suite("fidelity_smoke")[1])["fidelity_niah"]
    whole = ev.evaluate(model, ["fidelity_niah"], tok, configs={"fidelity_niah": dict(over)}, teacher=model)
    pieces = split_by_length("fidelity_niah", over)
    assert [label for label, _ in pieces] == ["fidelity_niah_1016", "fidelity_niah_4088"]
    split = pd.concat([ev.evaluate(model, ["fidelity_niah"], tok, configs={"fidelity_niah": cfg}, teacher=model)
                       for _, cfg in pieces], ignore_index=True)
    cols = ["metric", "family", "context_length", "value", "n", "status"]
    key = ["metric", "family", "context_length"]
    a = whole[cols].sort_values(key, ignore_index=True)
    b = split[cols].sort_values(key, ignore_index=True)
    assert len(a) and a.equals(b)
    # one length, or an evaluation without lengths: the whole evaluation
    assert split_by_length("fidelity_niah", {**over, "lengths": (1016,)}) == [("fidelity_niah",
                                                                                {**over, "lengths": (1016,)})]
    assert split_by_length("fidelity_text", {}) == [("fidelity_text", {})]


def test_run_suite_stops_after_the_part_in_hand_when_asked(tmp_path):
    """stop() is asked after each saved part: True ends the suite there (SuiteStopped), the part kept; the next call
    reads it back and runs the rest."""
    from headscope.reference import load_model
    from research.train_hybrid.run import SuiteStopped, run_suite

    model, tok = load_model("default")
    with pytest.raises(SuiteStopped, match="stopped after fidelity_text"):
        run_suite(model, tok, model, "fidelity_smoke", tmp_path, model_key="k1", stop=lambda: True)
    parts = sorted(p.name for p in (tmp_path / "fidelity_smoke_parts").iterdir() if p.is_dir())
    assert parts == ["fidelity_text"] and not (tmp_path / "fidelity_smoke").exists()
    rows = run_suite(model, tok, model, "fidelity_smoke", tmp_path, model_key="k1", stop=lambda: False)
    assert "fidelity_continuation" in set(rows["evaluation"])
