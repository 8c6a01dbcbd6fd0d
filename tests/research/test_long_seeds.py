"""research/long_seeds.py: recipes' perplexity past the teacher's context over seeds, from each run's suite rows."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from research import long_seeds


def _run(folder, ppl: dict[tuple[str, int], float], template: dict[int, float] | None = None):
    rows = [dict(evaluation="fidelity_long_text", family=src, context_length=L, metric=m, value=v * k, status="ok")
            for (src, L), v in ppl.items() for m, k in (("perplexity_student", 1.0), ("long_context_ratio", 0.1))]
    rows.append(dict(evaluation="fidelity_long_text", family="a", context_length=4096, metric="perplexity_teacher",
                     value=None, status="not_applicable"))
    (folder / "fidelity_long_reference").mkdir(parents=True)
    pd.DataFrame(rows).to_csv(folder / "fidelity_long_reference" / "results.csv", index=False)
    (folder / "fidelity_reference").mkdir()
    pd.DataFrame([dict(evaluation="fidelity_text", family="a", context_length=1024, metric="perplexity_ratio",
                       value=1.0, status="ok")]).to_csv(folder / "fidelity_reference" / "results.csv", index=False)
    if template:
        pd.DataFrame([dict(model=m, evaluation="niah", context_length=L, metric="accuracy", value=v, status="ok")
                      for L, v in template.items() for m in ("hybrid", "teacher")]).to_csv(
            folder / "eval_rows.csv", index=False)
        (folder / "niah_8184").mkdir()  # headscope eval --suite niah in the run folder: the hybrid's, no model column
        pd.DataFrame([dict(evaluation="niah", context_length=8184, metric="accuracy", value=v / 2, status="ok")
                      for v in template.values()]).to_csv(folder / "niah_8184" / "results.csv", index=False)
    return folder


def test_growth_is_per_seed_from_the_base_length_and_averaged_over_seeds(tmp_path):
    s0 = _run(tmp_path / "s0", {("a", 2048): 10.0, ("a", 4096): 9.0, ("b", 2048): 20.0, ("b", 4096): 24.0},
              {4096: 0.5})
    s1 = _run(tmp_path / "s1", {("a", 2048): 12.0, ("a", 4096): 12.0, ("b", 2048): 20.0, ("b", 4096): 20.0},
              {4096: 1.0})
    t = long_seeds.main([f"nope={s0},{s1}", "--out", str(tmp_path / "t.csv")]).set_index(["line", "length", "metric"])
    assert t.loc[("a", 4096, "growth"), "seed_0"] == pytest.approx(0.9)
    assert t.loc[("a", 4096, "growth"), "mean"] == pytest.approx(0.95)
    assert t.loc[("a", 4096, "growth"), "std"] == pytest.approx(math.sqrt(0.005))
    assert t.loc[("b", 4096, "growth"), "mean"] == pytest.approx(1.1)
    assert t.loc[(long_seeds.MEAN_LINE, 4096, "growth"), "seed_0"] == pytest.approx((0.9 + 1.2) / 2)
    assert t.loc[("a", 2048, "growth"), "mean"] == 1.0
    assert t.loc[("b", 4096, "long_context_ratio"), "mean"] == pytest.approx(2.2)  # as the rows give it
    assert t.loc[(long_seeds.MEAN_LINE, 4096, "long_context_ratio"), "seed_1"] == pytest.approx(1.6)
    assert t.loc[("template niah", 4096, "template_accuracy"), "mean"] == pytest.approx(0.75)
    assert t.loc[("template niah", 4096, "template_accuracy_teacher"), "seeds"] == 2
    assert t.loc[("template niah", 8184, "template_accuracy"), "mean"] == pytest.approx(0.375)
    assert ("template niah", 8184, "template_accuracy_teacher") not in t.index
    assert (tmp_path / "t.csv").is_file()


def test_bad_input_names_the_fix(tmp_path, capsys):
    s0 = _run(tmp_path / "s0", {("a", 1024): 10.0, ("a", 4096): 9.0})
    with pytest.raises(SystemExit):
        long_seeds.main([f"nope={s0}"])  # no perplexity at 2048
    assert "give one of them as --base-length" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        long_seeds.main([str(s0)])
    assert "NAME=RUN" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        long_seeds.main([f"x={tmp_path}"])
    assert "0 suites with fidelity_long_text rows" in capsys.readouterr().err


def test_template_only_reads_the_niah_of_runs_without_the_suite(tmp_path, capsys):
    """--template-only: runs with no fidelity_long suite give their own-template NIAH per length over seeds; a run
    with no NIAH rows at all is refused with where they come from."""
    runs = []
    for i, acc in enumerate((0.9, 0.5)):
        folder = tmp_path / f"s{i}" / "niah_16376"
        folder.mkdir(parents=True)
        pd.DataFrame([dict(evaluation="niah", context_length=16376, metric="accuracy", value=acc, status="ok")]).to_csv(
            folder / "results.csv", index=False)
        runs.append(str(folder.parent))
    t = long_seeds.main([f"part={','.join(runs)}", "--template-only"]).set_index(["line", "length", "metric"])
    row = t.loc[("template niah", 16376, "template_accuracy")]
    assert row["mean"] == pytest.approx(0.7) and row["seed_0"] == pytest.approx(0.9) and row["seeds"] == 2
    assert not [m for m in t.index.get_level_values("metric") if m.startswith("perplexity")]
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        long_seeds.main([f"x={tmp_path / 'empty'}", "--template-only"])
    assert "headscope eval --suite niah" in capsys.readouterr().err


def test_unseen_niah_joins_per_length_over_every_prompt_and_per_phrasing(tmp_path):
    runs = []
    for seed, hits in enumerate(((2, 1, 0), (2, 2, 1))):  # per cell: hits of 2 prompts (code, pin, plain)
        folder = _run(tmp_path / f"s{seed}", {("a", 2048): 10.0, ("a", 4096): 9.0})
        f = folder / "fidelity_long_reference" / "results.csv"
        d = pd.read_csv(f)
        niah = [dict(evaluation="fidelity_long_niah", family=f"{ph}+a", phrasing=ph, context_length=8184,
                     metric=m, value=h / 2 if m == "accuracy_student" else None, n=2,
                     status="ok" if m == "accuracy_student" else "not_applicable")
                for ph, h in zip(("code", "pin", "plain"), hits) for m in ("accuracy_student", "accuracy_teacher")]
        pd.concat([d, pd.DataFrame(niah)], ignore_index=True).to_csv(f, index=False)
        runs.append(folder)
    t = long_seeds.main([f"r={runs[0]},{runs[1]}"]).set_index(["line", "length", "metric"])
    assert t.loc[(long_seeds.NIAH_LINE, 8184, "niah_accuracy"), "seed_0"] == pytest.approx(3 / 6)
    assert t.loc[(long_seeds.NIAH_LINE, 8184, "niah_accuracy"), "seed_1"] == pytest.approx(5 / 6)
    assert t.loc[(long_seeds.NIAH_LINE, 8184, "niah_accuracy"), "std"] == pytest.approx(math.sqrt(2) / 6)
    assert t.loc[(f"{long_seeds.NIAH_LINE}: plain", 8184, "niah_accuracy"), "mean"] == pytest.approx(0.25)
    assert t.loc[(f"{long_seeds.NIAH_LINE}: code", 8184, "niah_accuracy"), "mean"] == 1.0


def test_a_suite_without_unseen_niah_has_no_niah_lines(tmp_path):
    s0 = _run(tmp_path / "s0", {("a", 2048): 10.0, ("a", 4096): 9.0})
    t = long_seeds.main([f"r={s0}"])
    assert "niah_accuracy" not in set(t.metric)
