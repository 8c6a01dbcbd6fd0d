"""headscope eval: a result folder written whole, refused when it holds other results, --overwrite, bad input."""
import json

import pytest

from headscope.cli import main
from headscope.evaluate import read_results, save_results
from headscope.io import OutputExistsError

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

SETS = ["--set", "niah.lengths=[200]", "--set", "niah.depths=[0.0,0.5,1.0]", "--set", "niah.n=1"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tiny_model("qwen3").save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return d


def run(folder, out, *extra):
    return main(["eval", "--model", str(folder), "--suite", "niah", "--out", str(out), "--quiet", *SETS, *extra])


def test_writes_a_complete_folder(folder, tmp_path, capsys):
    out = tmp_path / "res"
    assert run(folder, out) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["niah_heatmap.html", "niah_lines.html", "results.csv", "results.json", "summary.csv"]
    data = json.loads((out / "results.json").read_text())
    assert data["schema"] == "headscope.evaluation" and data["configs"]["niah"]["n"] == 1
    df = read_results(out)
    assert len(df[df.metric == "accuracy"]) == 3 and df.attrs["meta"]["seed"] == 0
    assert "niah" in capsys.readouterr().out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left


def test_refuses_a_folder_with_other_results_unless_overwrite(folder, tmp_path, capsys):
    out = tmp_path / "res"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert run(folder, out) == 2
    assert "not empty" in capsys.readouterr().err and (out / "notes.txt").read_text() == "mine"
    assert run(folder, out, "--overwrite") == 0
    assert (out / "results.json").exists() and not (out / "notes.txt").exists()
    assert run(folder, out) == 2
    assert "earlier evaluation results" in capsys.readouterr().err


def test_a_failed_write_leaves_the_old_folder(folder, tmp_path, monkeypatch):
    out = tmp_path / "res"
    assert run(folder, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    df = read_results(out)

    def boom(_):
        raise RuntimeError("disk full")

    monkeypatch.setattr("headscope.evaluate.figures.figures_for", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_results(df, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(OutputExistsError):
        save_results(df, out)


@pytest.mark.parametrize("args,msg", [
    (["--suite", "nope"], "unknown suite 'nope'; known suites: default, fidelity, fidelity_long, "
                          "fidelity_long_reference, fidelity_reference, fidelity_smoke, full, reasoning, retrieval, "
                          "smoke"),
    (["--suite", "niah", "nope"], "unknown evaluation 'nope'"),
    (["--set", "niah.bogus=1"], "no config field"),
    (["--set", "niahn=1"], "EVAL.FIELD=VALUE"),
])
def test_bad_input_is_one_line(folder, tmp_path, capsys, args, msg):
    argv = ["eval", "--model", str(folder), "--out", str(tmp_path / "r"), "--quiet", "--suite", "niah", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("headscope: error:") and msg in err
    assert not (tmp_path / "r").exists()


def test_tokenizer_that_does_not_match_the_model(folder, tmp_path, capsys):
    big = tmp_path / "tok"
    char_tokenizer(200).save_pretrained(big)
    assert run(folder, tmp_path / "r", "--tokenizer", str(big)) == 2
    assert "200 tokens but the model's embedding has 128 rows" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_hybrid_folder_needs_a_tokenizer(tmp_path, capsys):
    import hybrid
    from headscope.mask import HeadMask

    teacher = tiny_model("qwen3")
    hybrid.from_mask(teacher, HeadMask.for_model(teacher, [(0, 1), (1, 0), (2, 2)])).save_pretrained(tmp_path / "h")
    assert run(tmp_path / "h", tmp_path / "r") == 2
    assert "no tokenizer" in capsys.readouterr().err
    char_tokenizer().save_pretrained(tmp_path / "t")
    assert run(tmp_path / "h", tmp_path / "r", "--tokenizer", str(tmp_path / "t")) == 0
    assert json.loads((tmp_path / "r" / "results.json").read_text())["model_type"] == "headscope_hybrid"


def test_time_budget_flags(folder, tmp_path, capsys):
    out = tmp_path / "res"
    assert run(folder, out, "--time-limit", "1e-6") == 0  # spent at once: every row skipped, none missing
    df = read_results(out)
    assert len(df) == 6 and (df.status == "skipped").all() and df.note.str.startswith("budget:").all()
    assert run(folder, tmp_path / "r2", "--budget", "600") == 0
    assert (read_results(tmp_path / "r2").status == "ok").all()
    assert run(folder, tmp_path / "r3", "--budget", "-1") == 2
    assert "budget_s=-1.0: give seconds > 0" in capsys.readouterr().err
