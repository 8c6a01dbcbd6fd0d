"""The headscope command line: help, select/plot on synthetic files, score/run/knockout on a tiny model."""
import subprocess
import sys

import pandas as pd
import pytest
import torch

from headscope.cli import main
from headscope.mask import HeadMask
from headscope.results import HeadScores

from model_factories import tiny_model


def _write_scores(path, task, seed, kind="receiver", shape=(6, 3, 4)):
    g = torch.Generator().manual_seed(seed)
    HeadScores(task, torch.rand(*shape, generator=g), kind=kind, n_kv_heads=2).to_json(path)
    return str(path)


@pytest.mark.parametrize("command", [[], ["run"], ["score"], ["select"], ["knockout"], ["plot"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(command + ["--help"])
    assert exit_.value.code == 0
    assert "usage: headscope" in capsys.readouterr().out


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "headscope", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "score -> fuse -> select" in out.stdout


def test_select_end_to_end(tmp_path, model_dir, capsys):
    a = _write_scores(tmp_path / "niah.json", "niah", 0)
    b = _write_scores(tmp_path / "reasoning.json", "reasoning", 1)
    s = _write_scores(tmp_path / "niah_sender.json", "niah", 2, kind="sender")
    out = tmp_path / "mask.json"
    assert main(["select", "--scores", a, b, s, "--k", "4", "--model", str(model_dir), "--out", str(out)]) == 0
    mask = HeadMask.from_json(out)
    assert len(mask) == 4 and min(mask.per_layer_counts()) >= 1 and mask.fingerprint is not None
    assert mask.settings["strategy"] == "global_per_layer_min"
    assert mask.settings["fusion"]["tasks"] == ["niah", "reasoning"]
    assert "4 of 12 heads" in capsys.readouterr().out
    assert main(["select", "--scores", a, "--ratio", "2:1", "--strategy", "global", "--out", str(out)]) == 0
    assert len(HeadMask.from_json(out)) == 4
    from headscope.fusion import fuse  # a fused file is selected from as it is, not fused again
    fused = fuse([HeadScores.from_json(a), HeadScores.from_json(b)])
    fused.to_json(tmp_path / "fused.json")
    assert main(["select", "--scores", str(tmp_path / "fused.json"), "--k", "3", "--strategy", "global",
                 "--out", str(out)]) == 0
    assert set(HeadMask.from_json(out).fa_heads) == set(fused.top(3))


@pytest.mark.parametrize("args, message", [
    (["select", "--scores", "missing.json", "--k", "2", "--out", "m.json"], "does not exist"),
    (["select", "--scores", "{a}", "--ratio", "seven", "--out", "m.json"], "LA:FA"),
    (["select", "--scores", "{a}", "--k", "2", "--out", "m.json"], "k >= n_layers"),
    (["select", "--scores", "{a}", "{big}", "--k", "4", "--out", "m.json"], "differently shaped"),
    (["score", "--model", "no/such/folder", "--out", "s.json"], "no/such/folder"),
    (["score", "--n-samples", "0", "--out", "s.json"], "--n-samples must be >= 1"),
    (["plot", "heatmap", "--in", "{csv}", "--out", "x.html"], "not"),
])
def test_user_errors_are_one_line_exit_2(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    files = {"a": _write_scores(tmp_path / "a.json", "niah", 0),
             "big": _write_scores(tmp_path / "b.json", "reasoning", 0, shape=(2, 3, 8)),
             "csv": str(tmp_path / "c.csv")}
    (tmp_path / "c.csv").write_text("k,fraction\n0,0\n")
    assert main([a.format(**files) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("headscope: error: ") and message in err[-1] and "Traceback" not in "\n".join(err)


def test_plot_commands(tmp_path):
    scores = _write_scores(tmp_path / "s.json", "niah", 0)
    assert main(["plot", "heatmap", "--in", scores, "--out", str(tmp_path / "h.html")]) == 0
    mask = tmp_path / "m.json"
    assert main(["select", "--scores", scores, "--k", "3", "--out", str(mask)]) == 0
    assert main(["plot", "heatmap", "--in", str(mask), "--out", str(tmp_path / "hm.html")]) == 0
    assert main(["plot", "stability", "--in", scores, "--out", str(tmp_path / "st.html")]) == 0
    curve = pd.DataFrame({"k": [0, 1, 0, 1], "fraction": [0, 0.1, 0, 0.1], "selection": ["top"] * 2 + ["random"] * 2,
                          "seed": [None, None, 0, 0], "accuracy": [1, 0, 1, 1], "metric": [0.0] * 4})
    curve.to_csv(tmp_path / "c.csv", index=False)
    assert main(["plot", "knockout", "--in", str(tmp_path / "c.csv"), "--out", str(tmp_path / "k.html")]) == 0
    for name in ("h", "hm", "st", "k"):
        assert (tmp_path / f"{name}.html").stat().st_size > 1000


@pytest.mark.filterwarnings("ignore:the model answers only:UserWarning")  # a random tiny model fails NIAH
def test_score_run_knockout_on_a_tiny_model(tmp_path, model_dir, capsys):
    common = ["--model", str(model_dir), "--n-samples", "2", "--context-length", "64", "--quiet", "--device", "cpu"]
    assert main(["score", *common, "--task", "niah", "--out", str(tmp_path / "niah.json")]) == 0
    s = HeadScores.from_json(tmp_path / "niah.json")
    assert (s.n_samples, s.n_layers, s.n_heads) == (2, 3, 4) and s.task == "niah"

    out = tmp_path / "mask.json"
    assert main(["run", *common, "--quick", "--k", "3", "--out", str(out), "--save-scores", str(tmp_path / "scores"),
                 "--plot", str(tmp_path / "fused.html")]) == 0
    mask = HeadMask.from_json(out)
    assert len(mask) == 3 and mask.per_layer_counts() == [1, 1, 1] and mask.settings["tasks"] == ["niah"]
    assert (tmp_path / "scores" / "fused.json").exists() and (tmp_path / "fused.html").exists()
    mask.validate_for(tiny_model("qwen3"))

    curve = tmp_path / "curve.csv"
    assert main(["knockout", *common, "--scores", str(tmp_path / "niah.json"), "--n-random", "2",
                 "--max-fraction", "0.25", "--out", str(curve), "--plot", str(tmp_path / "curve.html")]) == 0
    df = pd.read_csv(curve)
    assert set(df.selection) == {"top", "random"} and df.k.max() == 3
    assert "mean accuracy top-k" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the whole method, checks first

@pytest.mark.filterwarnings("ignore:the model answers only:UserWarning")
def test_run_default_is_the_whole_method_and_quick_is_receiver_only(tmp_path, model_dir):
    common = ["--model", str(model_dir), "--n-samples", "2", "--context-length", "64", "--quiet", "--device", "cpu",
              "--k", "3"]
    out = tmp_path / "mask.json"
    assert main(["run", *common, "--sender-rounds", "1", "--out", str(out), "--save-scores", str(tmp_path / "s")]) == 0
    mask = HeadMask.from_json(out)
    assert mask.settings["tasks"] == ["niah", "reasoning"] and mask.settings["sender_rounds"] == 1
    assert mask.settings["fusion"]["tasks"] == ["niah", "reasoning"]
    for name in ("niah", "reasoning"):
        assert HeadScores.from_json(tmp_path / "s" / f"{name}.json").kind == "receiver"
        assert HeadScores.from_json(tmp_path / "s" / f"{name}.sender.json").kind == "sender"
    assert set(HeadScores.from_json(tmp_path / "s" / "fused.json").settings["kinds"].values()) == {"combined"}

    quick = tmp_path / "quick.json"
    assert main(["run", *common, "--quick", "--out", str(quick)]) == 0
    q = HeadMask.from_json(quick)
    assert q.settings["tasks"] == ["niah"] and q.settings["sender_rounds"] == 0
    assert q.settings["fusion"]["tasks"] == ["niah"] and q.settings["method"] == "receiver scores"


@pytest.fixture
def no_scoring(monkeypatch):
    """Fail the test if any scoring starts."""
    import headscope.api
    import headscope.senders

    def boom(*args, **kwargs):
        raise AssertionError("scoring ran although the command line could not succeed")

    monkeypatch.setattr(headscope.api, "score", boom)
    monkeypatch.setattr(headscope.senders, "iterated_path_patching", boom)


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and err[-1].startswith("headscope: error: ")
    return err[-1]


@pytest.mark.parametrize("extra, message", [
    (["--ratio", "seven"], "LA:FA"),
    (["--ratio", "7:0"], "FA part must be > 0"),
    (["--k", "2"], "k >= n_layers"),              # 3 layers need >= 3 FA heads with a per-layer minimum
    (["--fraction", "1.5"], "fraction"),
    (["--out", "{folder}"], "is a folder"),
    (["--out", "{other}"], "refusing to overwrite"),
    (["--save-scores", "{other}"], "is an existing file"),
    (["--save-scores", "{scoresdir}"], "refusing to overwrite"),
    (["--plot", "fig.svg"], ".html or .png"),
    (["--plot", "{other}"], ".html or .png"),
    (["--plot", "{noteshtml}"], "is not a figure"),
    (["--weights", "1", "2", "3"], "--weights has 3 values for 2 tasks"),
    (["--sender-rounds", "-1"], "--sender-rounds must be >= 0"),
    (["--sender-k", "0"], "--sender-k must be >= 1"),
])
def test_run_refuses_before_scoring(tmp_path, model_dir, capsys, no_scoring, extra, message):
    (tmp_path / "folder").mkdir()
    (tmp_path / "other.txt").write_text("my notes\n")
    (tmp_path / "notes.html").write_text("<p>my notes</p>")
    (tmp_path / "scoresdir").mkdir()
    (tmp_path / "scoresdir" / "niah.json").write_text('{"not": "scores"}')
    files = {"folder": str(tmp_path / "folder"), "other": str(tmp_path / "other.txt"),
             "scoresdir": str(tmp_path / "scoresdir"), "noteshtml": str(tmp_path / "notes.html")}
    args = ["run", "--model", str(model_dir), "--device", "cpu", "--quiet", "--out", str(tmp_path / "m.json")]
    assert main(args + [a.format(**files) for a in extra]) == 2
    assert message in _err(capsys)
    assert (tmp_path / "other.txt").read_text() == "my notes\n"  # untouched


def test_overwrite_flag_and_same_kind_artifacts(tmp_path, model_dir, capsys, no_scoring):
    """An existing file of another kind needs --overwrite; a mask over a mask does not (scoring then starts)."""
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    args = ["run", "--model", str(model_dir), "--device", "cpu", "--quiet", "--k", "3"]
    assert main(args + ["--out", str(other)]) == 2 and "--overwrite" in _err(capsys)
    with pytest.raises(AssertionError, match="scoring ran"):  # the checks pass: scoring starts
        main(["--debug"] + args + ["--out", str(other), "--overwrite"])
    HeadMask(fa_heads=[(0, 0)], n_layers=3, n_heads=4).to_json(tmp_path / "old_mask.json")
    with pytest.raises(AssertionError, match="scoring ran"):
        main(["--debug"] + args + ["--out", str(tmp_path / "old_mask.json")])
    assert other.read_text() == '{"mine": 1}'


@pytest.mark.parametrize("args, message", [
    (["score", "--out", "{other}"], "is not a headscope.head_scores file"),
    (["score", "--out", "{folder}"], "is a folder"),
    (["knockout", "--scores", "{scores}", "--out", "curve.txt"], "ending in .csv"),
    (["knockout", "--scores", "{scores}", "--out", "{othercsv}"], "not a knockout CSV"),
    (["knockout", "--scores", "{scores}", "--out", "c.csv", "--plot", "c.pdf"], ".html or .png"),
    (["plot", "heatmap", "--in", "{scores}", "--out", "h.svg"], ".html or .png"),
    (["plot", "heatmap", "--in", "{scores}", "--out", "{other}"], ".html or .png"),
    (["select", "--scores", "{scores}", "--k", "3", "--out", "{other}"], "is not a headscope.head_mask file"),
    (["select", "--scores", "{nan}", "--k", "3", "--out", "m.json"], "NaN/infinite"),
    (["select", "--scores", "{inf}", "--k", "3", "--out", "m.json"], "NaN/infinite"),
])
def test_other_commands_refuse_bad_outputs(tmp_path, monkeypatch, capsys, model_dir, no_scoring, args, message):
    monkeypatch.chdir(tmp_path)
    import headscope.cli as cli

    monkeypatch.setattr(cli, "_load_model", lambda *a: pytest.fail("the model was loaded before the checks"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "other.json").write_text('{"mine": 1}')
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    for name, value in (("nan", float("nan")), ("inf", float("inf"))):
        t = torch.rand(2, 3, 4)
        t[1, 2, 3] = value
        HeadScores("niah", t).to_json(tmp_path / f"{name}.json")
    files = {"folder": "folder", "other": "other.json", "othercsv": "other.csv", "nan": "nan.json",
             "inf": "inf.json", "scores": _write_scores(tmp_path / "s.json", "niah", 0, shape=(2, 3, 4))}
    assert main([a.format(**files) for a in args]) == 2
    assert message in _err(capsys)
    assert (tmp_path / "other.json").read_text() == '{"mine": 1}'


def test_a_large_n_samples_prints_the_estimate_before_starting(tmp_path, model_dir, capsys, monkeypatch):
    import headscope.api

    def stop(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(headscope.api, "score", stop)
    common = ["--model", str(model_dir), "--device", "cpu", "--n-samples", "100000", "--context-length", "64"]
    for cmd in (["score", *common, "--out", str(tmp_path / "s.json")],
                ["run", *common, "--k", "3", "--out", str(tmp_path / "m.json")]):
        assert main(cmd) == 130
        err = capsys.readouterr().err
        assert "estimated time: about" in err and "100000 samples" in err
        assert err.index("estimated time") < err.index("interrupted")
    assert not (tmp_path / "s.json").exists() and not (tmp_path / "m.json").exists()


def test_refusals_device_model_path_tokenizer(tmp_path, model_dir, capsys, no_scoring):
    import shutil

    if not torch.cuda.is_available():
        assert main(["score", "--model", str(model_dir), "--device", "cuda", "--out", str(tmp_path / "s.json")]) == 2
        assert "CUDA is not available" in _err(capsys)
    assert main(["score", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "s.json")]) == 2
    err = _err(capsys)
    assert "does not exist" in err and "train" not in err
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    for f in bare.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            f.unlink()
    assert main(["score", "--model", str(bare), "--device", "cpu", "--out", str(tmp_path / "s.json")]) == 2
    assert "holds no tokenizer" in (err := _err(capsys)) and "tokenizer.json" in err


def test_knockout_default_kind_is_patch():
    from headscope.cli import build_parser

    args = build_parser().parse_args(["knockout", "--scores", "s.json", "--out", "c.csv"])
    assert args.kind == "patch"
