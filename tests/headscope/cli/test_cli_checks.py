"""headscope's command line before and around long work: a PNG figure that cannot be written is refused before
any scoring (and a figure that fails at the end keeps the mask), --quiet silences transformers' own bars, and the
time estimate is revised from the first measured step."""
import sys
import types

import pytest

from headscope.cli import main
from headscope.mask import HeadMask
from headscope.results import HeadScores




def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and err[-1].startswith("headscope: error: ")
    return err[-1]


def _scores(path):
    import torch

    HeadScores("niah", torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(0)), n_kv_heads=2).to_json(path)
    return str(path)


def _commands(tmp_path, model_dir):
    model = ["--model", str(model_dir), "--device", "cpu", "--quiet"]
    s = _scores(tmp_path / "s.json")
    return {"run": ["run", *model, "--k", "3", "--out", str(tmp_path / "m.json"), "--plot", str(tmp_path / "f.png")],
            "knockout": ["knockout", *model, "--scores", s, "--out", str(tmp_path / "c.csv"), "--plot",
                         str(tmp_path / "c.png")],
            "plot": ["plot", "heatmap", "--in", s, "--out", str(tmp_path / "h.png")]}


@pytest.mark.parametrize("command", ["run", "knockout", "plot"])
def test_png_without_kaleido_is_refused_before_any_work(tmp_path, model_dir, monkeypatch, capsys, no_scoring,
                                                         command):
    import headscope.cli.common as common

    monkeypatch.setitem(sys.modules, "kaleido", None)  # `import kaleido` raises ImportError
    monkeypatch.setattr(common, "load_model", lambda *a: pytest.fail("the model was loaded before the check"))
    assert main(_commands(tmp_path, model_dir)[command]) == 2
    err = _err(capsys)
    assert "PNG export needs kaleido" in err and "pip install kaleido" in err and ".html" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]  # nothing written


def test_png_exporter_without_a_browser_is_refused_before_scoring(tmp_path, model_dir, monkeypatch, capsys,
                                                                  no_scoring):
    import plotly.graph_objects as go

    monkeypatch.setitem(sys.modules, "kaleido", types.ModuleType("kaleido"))

    def no_browser(self, *a, **k):
        raise RuntimeError("Kaleido requires Google Chrome to be installed")

    monkeypatch.setattr(go.Figure, "to_image", no_browser)
    assert main(_commands(tmp_path, model_dir)["run"]) == 2
    err = _err(capsys)
    assert "PNG export does not work here" in err and "Chrome" in err and not (tmp_path / "m.json").exists()


@pytest.mark.filterwarnings("ignore:the model answers only:UserWarning")
def test_run_keeps_the_mask_when_the_figure_fails_at_the_end(tmp_path, model_dir, monkeypatch, capsys):
    """The exporter passed the check but fails when the figure is written: the mask is written all the same."""
    import plotly.graph_objects as go

    monkeypatch.setitem(sys.modules, "kaleido", types.ModuleType("kaleido"))
    calls = []

    def first_only(self, *a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the browser went away")
        return b"\x89PNG\r\n\x1a\n"

    monkeypatch.setattr(go.Figure, "to_image", first_only)
    out, fig = tmp_path / "m.json", tmp_path / "f.png"
    assert main(["run", "--model", str(model_dir), "--device", "cpu", "--quiet", "--quick", "--n-samples", "2",
                 "--context-length", "64", "--k", "3", "--out", str(out), "--plot", str(fig)]) == 2
    err = _err(capsys)
    assert "PNG export failed" in err and f"the mask was written to {out}" in err
    assert len(HeadMask.from_json(out)) == 3 and fig.with_suffix(".html").is_file() and not fig.exists()


def test_quiet_silences_the_loading_bar(tmp_path, model_dir, capfd, no_scoring):
    from transformers.utils import logging as hf_logging

    args = ["score", "--model", str(model_dir), "--device", "cpu", "--out", str(tmp_path / "s.json")]
    assert hf_logging.is_progress_bar_enabled()
    main(args)  # scoring is stopped by no_scoring; the model was loaded
    assert "Loading weights" in capfd.readouterr().err
    main(args + ["--quiet"])
    err = capfd.readouterr().err
    assert "loading model" in err and "Loading weights" not in err
    assert hf_logging.is_progress_bar_enabled()  # restored for whatever runs next in the process


def test_the_estimate_is_revised_from_the_first_step(monkeypatch, capsys):
    from headscope.cli import build_parser, estimate

    monkeypatch.setattr(estimate, "task_seconds", lambda *a: {"niah": (10.0, 20.0), "reasoning": (5.0, 5.0)})
    args = build_parser().parse_args(["run"])
    est = estimate.Estimate(None, None, ["niah", "reasoning"], args, 3)
    assert "estimated time: about 40 s" in capsys.readouterr().err
    est.first_step("niah", 20.0)  # twice the estimate: the rest (30 s) doubles
    err = capsys.readouterr().err
    assert "re-estimated from the first step (niah receiver scores: 20.0s, estimated 10.0s): about 60 s left" in err
    est.first_step("reasoning", 1.0)  # only the first step revises
    assert capsys.readouterr().err == ""


@pytest.mark.filterwarnings("ignore:the model answers only:UserWarning")
def test_run_prints_the_revised_estimate_before_the_rest(tmp_path, model_dir, capsys):
    assert main(["run", "--model", str(model_dir), "--device", "cpu", "--quiet", "--task", "niah", "--n-samples", "2",
                 "--context-length", "64", "--sender-rounds", "1", "--k", "3", "--out", str(tmp_path / "m.json")]) == 0
    err = capsys.readouterr().err
    assert err.index("estimated time: about") < err.index("scored niah") < err.index("re-estimated from the first") \
        < err.index("sender scores on niah")
