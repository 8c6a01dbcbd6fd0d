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
    import headscope.cli.common as common

    monkeypatch.setattr(common, "load_model", lambda *a: pytest.fail("the model was loaded before the checks"))
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


# ----------------------------------------------------------------------------- scores, masks and models that disagree

def test_select_refuses_scores_of_another_shape_than_the_model(tmp_path, capsys):
    """8 x 4 scores with the 8 x 8 default model: both shapes and the fix, not 'k >= n_layers'."""
    scores = _write_scores(tmp_path / "s.json", "niah", 0, shape=(2, 8, 4))
    assert main(["select", "--model", "default", "--scores", scores, "--out", str(tmp_path / "m.json")]) == 2
    err = _err(capsys)
    assert "8 layers x 4 heads" in err and "8 layers x 8 heads" in err and "k >= n_layers" not in err
    assert "scores of this model" in err and "--model the scores came from" in err
    assert not (tmp_path / "m.json").exists()


def test_select_without_model_uses_the_model_the_scores_record(tmp_path, model_dir, capsys):
    from headscope.mask import config_fingerprint
    from headscope.selection import select as _sel

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    g = torch.Generator().manual_seed(0)
    # a scores file that records its model's folder (as `headscope score` does): the mask gets its config
    s = HeadScores("niah", torch.rand(2, 3, 4, generator=g), n_kv_heads=None,
                   settings={"model": str(model_dir), "n_layers": 3, "n_heads": 4})
    s.to_json(tmp_path / "s.json")
    out = tmp_path / "m.json"
    assert main(["select", "--scores", str(tmp_path / "s.json"), "--k", "3", "--out", str(out)]) == 0
    mask = HeadMask.from_json(out)
    assert mask.fingerprint == config_fingerprint(cfg) and mask.n_kv_heads == cfg.num_key_value_heads
    assert (mask.n_layers, mask.n_heads) == (3, 4) and mask.settings["model"] == str(model_dir)
    err = capsys.readouterr().err
    assert "no --model" in err and "the model the scores record" in err and config_fingerprint(cfg) in err
    mask.validate_for(cfg)
    # only a fingerprint recorded (the model folder is gone): the mask carries the recorded fields
    s.settings = {"model": str(tmp_path / "gone"), "config_fingerprint": "abcd1234abcd1234", "model_type": "qwen3"}
    s.n_kv_heads = 2
    s.to_json(tmp_path / "s2.json")
    assert main(["select", "--scores", str(tmp_path / "s2.json"), "--k", "3", "--out", str(out)]) == 0
    mask = HeadMask.from_json(out)
    assert (mask.fingerprint, mask.model_type, mask.n_kv_heads) == ("abcd1234abcd1234", "qwen3", 2)
    assert set(mask.fa_heads) == set(_sel(s, k=3, strategy="global_per_layer_min").fa_heads)
    assert "abcd1234abcd1234" in capsys.readouterr().err
    # nothing recorded: the scores' shape, and the log says how to record the model
    plain = _write_scores(tmp_path / "p.json", "niah", 0)
    assert main(["select", "--scores", plain, "--k", "3", "--out", str(out)]) == 0
    assert HeadMask.from_json(out).fingerprint is None
    assert "record no model" in capsys.readouterr().err
    # files of two different models are refused
    s.settings = {"config_fingerprint": "ffff0000ffff0000"}
    s.task = "reasoning"
    s.to_json(tmp_path / "s3.json")
    assert main(["select", "--scores", str(tmp_path / "s2.json"), str(tmp_path / "s3.json"), "--k", "3",
                 "--out", str(out)]) == 2
    assert "different models" in _err(capsys)


def test_select_with_a_recorded_model_of_another_shape_is_refused(tmp_path, model_dir, capsys):
    """The scores record a model folder whose shape is not theirs: named, not a silent mismatch."""
    HeadScores("niah", torch.rand(2, 8, 4), settings={"model": str(model_dir)}).to_json(tmp_path / "s.json")
    assert main(["select", "--scores", str(tmp_path / "s.json"), "--k", "8", "--out", str(tmp_path / "m.json")]) == 2
    err = _err(capsys)
    assert "8 layers x 4 heads" in err and "3 layers x 4 heads" in err and "the model they record" in err
    # no local config to compare with: the recorded n_layers x n_heads disagree with the scores
    HeadScores("niah", torch.rand(2, 8, 4), settings={"model": "gone/model", "n_layers": 8, "n_heads": 8}).to_json(
        tmp_path / "s2.json")
    assert main(["select", "--scores", str(tmp_path / "s2.json"), "--k", "8", "--out", str(tmp_path / "m.json")]) == 2
    err = _err(capsys)
    assert "8 layers x 4 heads" in err and "8 layers x 8 heads" in err and "gone/model" in err


@pytest.mark.parametrize("mask_shape, scores_shape", [((16, 8), (8, 8)), ((8, 8), (8, 4))])
def test_plot_heatmap_refuses_a_mask_of_another_shape(tmp_path, capsys, mask_shape, scores_shape):
    L, H = mask_shape
    HeadMask(fa_heads=[(L - 1, H - 1)], n_layers=L, n_heads=H).to_json(tmp_path / "m.json")
    scores = _write_scores(tmp_path / "s.json", "niah", 0, shape=(2, *scores_shape))
    assert main(["plot", "heatmap", "--in", scores, "--mask", str(tmp_path / "m.json"),
                 "--out", str(tmp_path / "h.html")]) == 2
    err = _err(capsys)
    assert f"{L} layers x {H} heads" in err and f"{scores_shape[0]} layers x {scores_shape[1]} heads" in err
    assert "the mask selected from these scores" in err and not (tmp_path / "h.html").exists()
    # a mask file as --in (its own scores) with a --mask of another shape
    HeadMask(fa_heads=[(0, 0)], n_layers=scores_shape[0], n_heads=scores_shape[1],
             scores=torch.rand(*scores_shape).tolist()).to_json(tmp_path / "in.json")
    assert main(["plot", "heatmap", "--in", str(tmp_path / "in.json"), "--mask", str(tmp_path / "m.json"),
                 "--out", str(tmp_path / "h.html")]) == 2
    assert f"{L} layers x {H} heads" in _err(capsys)


def test_plot_similarity_names_what_it_expected_and_what_it_got(tmp_path, capsys):
    scores = _write_scores(tmp_path / "s.json", "niah", 0)
    assert main(["plot", "similarity", "--in", scores, "--out", str(tmp_path / "x.html")]) == 2
    err = _err(capsys)
    assert "layer-similarity CSV" in err and "scores JSON file" in err and "plot heatmap" in err
    HeadMask(fa_heads=[(0, 0)], n_layers=3, n_heads=4).to_json(tmp_path / "m.json")
    assert main(["plot", "similarity", "--in", str(tmp_path / "m.json"), "--out", str(tmp_path / "x.html")]) == 2
    assert "head-mask JSON file" in _err(capsys)
    (tmp_path / "c.csv").write_text("k,fraction,selection\n0,0,top\n1,0.1,top\n")
    assert main(["plot", "similarity", "--in", str(tmp_path / "c.csv"), "--out", str(tmp_path / "x.html")]) == 2
    assert "layer-similarity CSV" in (err := _err(capsys)) and "knockout CSV" in err and "plot knockout" in err
    (tmp_path / "r.csv").write_text("name,a,b\nx,1,2\n")
    assert main(["plot", "similarity", "--in", str(tmp_path / "r.csv"), "--out", str(tmp_path / "x.html")]) == 2
    assert "layer-similarity CSV" in (err := _err(capsys)) and "1 x 2 table" in err and "not a square matrix" in err
    import numpy as np

    pd.DataFrame(np.eye(3), index=["embed", "L0", "L1"], columns=["embed", "L0", "L1"]).to_csv(tmp_path / "sim.csv")
    assert main(["plot", "similarity", "--in", str(tmp_path / "sim.csv"), "--out", str(tmp_path / "x.html")]) == 0
    assert (tmp_path / "x.html").exists()
