"""research/train_hybrid/run.py's run_suite: each evaluation of the suite saved as soon as it is done; after a call
cut short the finished ones are read back (not run again), parts of another model are dropped; the rows and the
chat answers end in OUT/<suite>/."""
from __future__ import annotations

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
    assert [c[0] for c in calls] == names and set(rows["evaluation"]) == set(names)
    assert set(read_results(tmp_path / "fidelity_smoke")["evaluation"]) == set(names)
    side = sorted(p.name for p in (tmp_path / "fidelity_smoke_parts").glob("*/*.jsonl"))
    assert side == sorted(p.name for p in (tmp_path / "fidelity_smoke").glob("*.jsonl"))  # (no chat template here:
    #                                                                  the reference model's chat rows are skipped)
    ok = rows[(rows["status"] == "ok") & (rows["metric"] == "top1_agreement")]
    assert len(ok) and (ok["value"] == 1).all()  # the model against itself

    # a call cut short during the last evaluation: the other three are read back
    import shutil

    shutil.rmtree(tmp_path / "fidelity_smoke_parts" / "fidelity_niah")
    calls.clear()
    again = run_suite(model, tok, model, "fidelity_smoke", tmp_path, model_key="k1")
    assert calls == [("fidelity_niah",)] and len(again) == len(rows)

    # another model's parts are not reused
    calls.clear()
    run_suite(model, tok, model, "fidelity_smoke", tmp_path, model_key="k2")
    assert [c[0] for c in calls] == names
