"""research.fidelity_seeds: means, spreads and gaps to the targets over seeds' fidelity rows."""
import json
import math

import pandas as pd
import pytest

from research import fidelity_seeds


def rows(ppl: float, top1: float, acc: float) -> pd.DataFrame:
    r = [dict(evaluation="fidelity_text", metric="perplexity_ratio", value=ppl, family="prose", status="ok"),
         dict(evaluation="fidelity_text", metric="top1_agreement", value=top1, family="prose", status="ok"),
         dict(evaluation="fidelity_niah", metric="accuracy_student", value=acc, family="s", context_length=2040,
              status="ok"),
         dict(evaluation="fidelity_niah", metric="accuracy_teacher", value=0.9, family="s", context_length=2040,
              status="ok")]
    return pd.DataFrame(r)


def test_mean_std_gap_and_every_seed(tmp_path):
    rows(1.10, 0.70, 0.88).to_csv(tmp_path / "s0.csv", index=False)
    rows(1.30, 0.74, 0.80).to_csv(tmp_path / "s1.csv", index=False)
    t = fidelity_seeds.main([str(tmp_path / "s0.csv"), str(tmp_path / "s1.csv"), "--seeds", "3,4",
                             "--out", str(tmp_path / "t.csv")]).set_index(["line", "metric"])
    ppl = t.loc[("prose", "perplexity_ratio")]
    assert ppl["mean"] == pytest.approx(1.20) and ppl["std"] == pytest.approx(0.1414, abs=1e-4)
    assert ppl["seed_3"] == 1.10 and ppl["target"] == "<= 1.15"
    assert ppl["gap"] == pytest.approx(0.05) and not ppl["met_every_seed"]  # seed 3 alone meets it, seed 4 not
    assert t.loc[("prose", "top1_agreement"), "gap"] == pytest.approx(0.08)
    diff = t.loc[("niah @2040", "accuracy_difference")]
    assert diff["mean"] == pytest.approx(-0.06) and diff["gap"] == pytest.approx(0.01)
    assert math.isnan(t.loc[("niah @2040", "accuracy_student"), "gap"])  # no target of its own
    assert pd.read_csv(tmp_path / "t.csv").shape[0] == len(t)


def test_met_target_has_no_gap(tmp_path):
    rows(1.05, 0.85, 0.9).to_csv(tmp_path / "a.csv", index=False)
    rows(1.10, 0.82, 0.9).to_csv(tmp_path / "b.csv", index=False)
    t = fidelity_seeds.main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]).set_index(["line", "metric"])
    assert t.loc[("prose", "perplexity_ratio"), "gap"] == 0 and t.loc[("prose", "perplexity_ratio"), "met_every_seed"]
    assert t.loc[("niah @2040", "accuracy_difference"), "gap"] == 0


def test_a_line_one_seed_lacks_is_judged_by_the_seeds_that_have_it(tmp_path):
    rows(1.05, 0.85, 0.88).to_csv(tmp_path / "a.csv", index=False)
    rows(1.10, 0.82, 0.9).query("evaluation != 'fidelity_niah'").to_csv(tmp_path / "b.csv", index=False)  # NIAH cut
    t = fidelity_seeds.main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]).set_index(["line", "metric"])
    diff = t.loc[("niah @2040", "accuracy_difference")]
    assert diff["seeds"] == 1 and diff["gap"] == 0 and diff["met_every_seed"]  # -0.02 >= -0.05 in the seed that ran
    rows(1.05, 0.85, 0.80).to_csv(tmp_path / "a.csv", index=False)
    t = fidelity_seeds.main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]).set_index(["line", "metric"])
    assert not t.loc[("niah @2040", "accuracy_difference"), "met_every_seed"]  # -0.10 misses it


def test_bad_input_names_the_fix(tmp_path, capsys):
    rows(1.0, 0.9, 0.9).to_csv(tmp_path / "a.csv", index=False)
    with pytest.raises(SystemExit):
        fidelity_seeds.main([str(tmp_path / "a.csv"), "--seeds", "0,1"])
    assert "one per rows file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fidelity_seeds.main([str(tmp_path / "missing")])
    assert "no such file" in capsys.readouterr().err


def test_the_template_niah_and_gpu_minutes_join_from_the_run_files(tmp_path):
    for seed, (acc, minutes) in enumerate(((1.0, 4.0), (0.9, 5.0))):
        folder = tmp_path / f"s{seed}" / "fidelity"
        folder.mkdir(parents=True)
        rows(1.0, 0.9, 0.9).to_csv(folder / "results.csv", index=False)  # run.py's run folder: fidelity/results.csv
        pd.DataFrame([dict(model=m, evaluation="niah", metric="accuracy", value=v, context_length=2040, status="ok")
                      for m, v in (("hybrid", acc), ("teacher", 1.0))]).to_csv(folder.parent / "eval_rows.csv",
                                                                                  index=False)
        (folder.parent / "results.json").write_text(json.dumps({"train": {"minutes_total": minutes}}))
    t = fidelity_seeds.main([str(tmp_path / "s0"), str(tmp_path / "s1" / "fidelity" / "results.csv")])
    t = t.set_index(["line", "metric"])
    tmpl = t.loc[("template niah @2040", "template_accuracy")]
    assert tmpl["mean"] == pytest.approx(0.95) and tmpl["target"] == ">= 0.95" and not tmpl["met_every_seed"]
    assert t.loc[("template niah @2040", "template_accuracy_teacher"), "mean"] == 1.0
    gpu = t.loc[("training", "gpu_minutes")]
    assert gpu["mean"] == 4.5 and gpu["gap"] == 0 and gpu["met_every_seed"]


def test_one_file_with_a_train_seed_column_gives_its_seeds(tmp_path, capsys):
    both = pd.concat([rows(1.10, 0.70, 0.88).assign(train_seed=0), rows(1.30, 0.74, 0.80).assign(train_seed=1)])
    both.to_csv(tmp_path / "both.csv", index=False)
    t = fidelity_seeds.main([str(tmp_path / "both.csv")]).set_index(["line", "metric"])
    assert t.loc[("prose", "perplexity_ratio"), "mean"] == pytest.approx(1.20)
    assert t.loc[("prose", "perplexity_ratio"), "seeds"] == 2
    with pytest.raises(SystemExit):
        fidelity_seeds.main([str(tmp_path / "both.csv"), "--seeds", "5"])
    assert "train_seed column" in capsys.readouterr().err


def test_base_puts_another_recipes_mean_and_spread_beside_each_line(tmp_path):
    rows(1.10, 0.80, 0.88).to_csv(tmp_path / "v.csv", index=False)  # the variant: one seed
    rows(1.30, 0.78, 0.80).to_csv(tmp_path / "b0.csv", index=False)  # the base: two seeds
    rows(1.32, 0.82, 0.86).to_csv(tmp_path / "b1.csv", index=False)
    t = fidelity_seeds.main([str(tmp_path / "v.csv"), "--seeds", "0", "--base", str(tmp_path / "b0.csv"),
                             str(tmp_path / "b1.csv")]).set_index(["line", "metric"])
    ppl = t.loc[("prose", "perplexity_ratio")]
    assert ppl["base_mean"] == pytest.approx(1.31) and ppl["base_std"] == pytest.approx(0.01414, abs=1e-4)
    assert ppl["change"] == pytest.approx(-0.21) and ppl["outside_base"]  # 1.10 below both 1.30 and 1.32
    assert not t.loc[("prose", "top1_agreement"), "outside_base"]  # 0.80 lies between the base's 0.78 and 0.82
    assert t.loc[("niah @2040", "accuracy_student"), "change"] == pytest.approx(0.05)


def test_a_missing_base_is_named(tmp_path, capsys):
    rows(1.0, 0.9, 0.9).to_csv(tmp_path / "a.csv", index=False)
    with pytest.raises(SystemExit):
        fidelity_seeds.main([str(tmp_path / "a.csv"), "--base", str(tmp_path / "nope.csv")])
    assert "--base" in capsys.readouterr().err


def test_a_run_folder_of_another_fidelity_suite_is_read_and_two_suites_are_refused(tmp_path):
    """run.py --suite fidelity_reference writes fidelity_reference/results.csv: the folder is read as it is; a
    folder with two suites' rows names both instead of picking one."""
    for seed in (0, 1):
        folder = tmp_path / f"s{seed}" / "fidelity_reference"
        folder.mkdir(parents=True)
        rows(1.0 + seed / 10, 0.9, 0.9).to_csv(folder / "results.csv", index=False)
    assert len(fidelity_seeds.read_rows(tmp_path / "s0")) == len(rows(1.0, 0.9, 0.9))
    (tmp_path / "s1" / "fidelity_long").mkdir()
    rows(1.0, 0.9, 0.9).to_csv(tmp_path / "s1" / "fidelity_long" / "results.csv", index=False)
    with pytest.raises(FileNotFoundError, match="2 suites' rows .*fidelity_long.*fidelity_reference"):
        fidelity_seeds.read_rows(tmp_path / "s1")


def test_a_suite_cut_short_is_read_from_its_finished_parts(tmp_path):
    """A study row whose suite was cut before its last evaluation has fidelity_parts/<evaluation>/results.csv and
    no fidelity/: the finished parts are read, together, and the finished suite wins once it exists."""
    text, niah = rows(1.1, 0.8, 0.7).iloc[:2], rows(1.1, 0.8, 0.7).iloc[2:]
    for name, part in (("fidelity_text", text), ("fidelity_niah_2040", niah)):
        (tmp_path / "fidelity_parts" / name).mkdir(parents=True)
        part.to_csv(tmp_path / "fidelity_parts" / name / "results.csv", index=False)
    got = fidelity_seeds.read_rows(tmp_path)
    assert sorted(got.evaluation) == sorted(rows(1.1, 0.8, 0.7).evaluation)
    assert got[got.metric == "perplexity_ratio"].value.tolist() == [1.1]
    (tmp_path / "fidelity").mkdir()
    rows(1.0, 0.9, 0.9).to_csv(tmp_path / "fidelity" / "results.csv", index=False)
    assert fidelity_seeds.read_rows(tmp_path)[lambda d: d.metric == "perplexity_ratio"].value.tolist() == [1.0]
