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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 saved with a tiny word-level tokenizer (digits split), as `--model PATH` expects."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the special magic number is what ? answer : . question".split()
    vocab = {"<unk>": 0, "<s>": 1, **{str(d): 2 + d for d in range(10)}, **{w: 12 + i for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    path = tmp_path_factory.mktemp("tiny_model")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>").save_pretrained(path)
    tiny_model("qwen3").save_pretrained(path)
    return path


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
    assert main(["run", *common, "--k", "3", "--out", str(out), "--save-scores", str(tmp_path / "scores"),
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
