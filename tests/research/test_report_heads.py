"""research/report_heads.py end to end on a tiny Llama (char tokenizer), CPU, tiny settings."""
from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "research" / "report_heads.py"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", attn_implementation="sdpa").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def test_report_on_a_tiny_model(tiny_folder, tmp_path, capsys):
    report = runpy.run_path(str(SCRIPT), run_name="report_heads")
    md = tmp_path / "tiny_heads.md"
    report["main"](["--model", str(tiny_folder), "--threads", "1", "--n-niah", "3", "--context", "200",
                    "--n-reason", "2", "--families", "comparison,two_hop", "--n-knockout", "2", "--n-random", "1",
                    "--path-k", "1", "--path-rounds", "1", "--n-path", "2", "--n-boot", "2",
                    "--out-dir", str(tmp_path / "out"), "--md", str(md), "--figures", str(tmp_path / "fig")])
    out = json.loads((tmp_path / "out" / "heads.json").read_text())
    assert "--n-path 2" in out["command"]  # the recorded command reproduces the run
    assert out["model"]["total_heads"] == 12 and len(out["niah"]["scores"]) == 3
    assert set(out["knockout"]) == {"patch", "mean"}  # the paper's patch AND mean ablation, both explicit
    for ko in out["knockout"].values():
        assert ko["curve"][0]["k"] == 0 and ko["k_1pct"] == 1
    assert set(out["reasoning"]["clean_accuracy"]) == {"comparison", "two_hop"}
    assert len(out["claims"]) == 5 and all(c["verdict"] for c in out["claims"])
    assert (tmp_path / "out" / "mask_7to1.json").exists()
    card = (tmp_path / "out" / "README.md").read_text()  # the run folder's card (tests/docs/test_results_index.py)
    for field in ("**made by**", "**when**", "**on**", "**cited by**", "`heads.json`", "`mask_7to1.json`"):
        assert field in card, field
    assert "cut short" not in card
    figs = {p.name for p in (tmp_path / "fig").iterdir()}
    slug = tiny_folder.name.lower()
    assert {f"{slug}_niah_heatmap.html", f"{slug}_knockout_patch.html", f"{slug}_knockout_mean.html",
            f"{slug}_similarity.html", f"{slug}_stability.html", f"{slug}_sender_heatmap.html"} <= figs
    text = md.read_text()
    assert "## The paper's head-level claims on this model" in text and "top-1% knockout" in text
    assert f"[{slug}_stability.html](fig/{slug}_stability.html)" in text  # figures linked relative to the report
    assert "the paper's head-level claims" in capsys.readouterr().out


def test_report_writes_each_section_as_it_goes(tiny_folder, tmp_path):
    """A run stopped after the NIAH section (as a GPU timeout would) keeps heads.json and a card listing only
    the files that exist."""
    report = runpy.run_path(str(SCRIPT), run_name="report_heads")
    g = report["main"].__globals__
    real_save = g["save"]

    def save_then_stop(a, out):
        real_save(a, out)
        raise KeyboardInterrupt  # the first section is written; stop here

    g["save"] = save_then_stop
    with pytest.raises(KeyboardInterrupt):
        report["main"](["--model", str(tiny_folder), "--threads", "1", "--n-niah", "2", "--context", "200",
                        "--families", "", "--out-dir", str(tmp_path / "out"), "--md", "", "--figures", ""])
    out = json.loads((tmp_path / "out" / "heads.json").read_text())
    assert len(out["niah"]["scores"]) == 3 and "claims" not in out
    card = (tmp_path / "out" / "README.md").read_text()
    assert "cut short" in card and "**made by**" in card and "mask_7to1.json" not in card


def test_bad_arguments_are_refused():
    report = runpy.run_path(str(SCRIPT), run_name="report_heads")
    with pytest.raises(SystemExit, match="--families"):
        report["parse_args"](["--families", "poetry"])
    with pytest.raises(SystemExit, match="--n-niah"):
        report["parse_args"](["--n-niah", "1"])
    a = report["parse_args"](["--device", "cuda", "--model", "smollm2-135m"])
    assert (a.n_niah, a.context) == report["SIZES"]["cuda"][:2] and a.slug == "smollm2_135m"


def test_it_writes_a_results_folder_unless_asked_for_the_docs():
    """By default every output goes into one results folder under runs/ (the tracked docs are left alone);
    --into-docs writes where the published report lives; explicit paths win either way."""
    import time

    report = runpy.run_path(str(SCRIPT), run_name="report_heads")
    root = report["ROOT"]
    a = report["parse_args"](["--model", "smollm2-135m"])
    folder = Path("runs") / f"{time.strftime('%Y-%m-%d')}_report_heads_smollm2_135m"
    assert (a.out_dir, a.md, Path(a.figures)) == (folder, folder / "heads.md", folder / "figures")
    d = report["parse_args"](["--model", "smollm2-135m", "--into-docs"])
    docs = root / "docs"
    assert (d.out_dir, d.md, Path(d.figures)) == (docs / "results" / "smollm2_135m", docs / "smollm2_135m_heads.md",
                                                  docs / "figures")
    e = report["parse_args"](["--out-dir", "x", "--md", "", "--figures", "f"])
    assert (e.out_dir, e.md, e.figures) == (Path("x"), None, "f")
    o = report["parse_args"](["--out-dir", "x"])
    assert (o.md, Path(o.figures)) == (Path("x/heads.md"), Path("x/figures"))


def test_a_default_run_leaves_the_checkout_alone(tiny_folder, tmp_path, monkeypatch):
    import time

    report = runpy.run_path(str(SCRIPT), run_name="report_heads")
    g = report["main"].__globals__
    real_save = g["save"]

    def save_then_stop(a, out):
        real_save(a, out)
        raise KeyboardInterrupt  # the first section is written; stop here

    g["save"] = save_then_stop
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        report["main"](["--model", str(tiny_folder), "--threads", "1", "--n-niah", "2", "--context", "200",
                        "--families", ""])
    folder = tmp_path / "runs" / f"{time.strftime('%Y-%m-%d')}_report_heads_{tiny_folder.name.lower()}"
    assert (folder / "heads.json").is_file() and (folder / "README.md").is_file()
    docs, slug = report["ROOT"] / "docs", tiny_folder.name.lower()
    assert not (docs / "results" / slug).exists() and not (docs / f"{slug}_heads.md").exists()
    assert not list((docs / "figures").glob(f"{slug}_*")) and not list(folder.parent.glob("*/figures/*"))


def test_task_accuracy_dry_run(tiny_folder, tmp_path, capsys):
    script = runpy.run_path(str(SCRIPT.parent / "task_accuracy.py"), run_name="task_accuracy")
    rows = script["main"](["--model", str(tiny_folder), "--dry-run", "--tasks", "niah,comparison",
                           "--contexts", "200,512,1024", "--threads", "1", "--out", str(tmp_path / "acc.json")])
    assert [(r["task"], r["context"], r["n"]) for r in rows] == [("niah", 200, 4), ("niah", 512, 4),
                                                                 ("comparison", None, 4)]
    assert all(0.0 <= r["clean_accuracy"] <= 1.0 for r in rows)
    assert json.loads((tmp_path / "acc.json").read_text())["rows"][0]["task"] == "niah"
    with pytest.raises(SystemExit, match="--tasks"):
        script["parse_args"](["--tasks", "poetry"])
