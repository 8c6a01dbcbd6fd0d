"""hybrid-train's refusals of bad input: one line naming the problem and the fix, exit code 2, before any model
is loaded (an unusable output path or device) or before the run folder is made (a corpus too short)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import hybrid.train.build as build
from hybrid.train.cli import main
from test_train_distributed_cli import write_toml


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(build, "load_teacher", refuse)
    monkeypatch.setattr(build, "build_pretrain_model", refuse)


def error_line(capsys) -> str:
    err = capsys.readouterr().err  # may also hold the teacher's weight-loading progress bar
    lines = [line for line in err.splitlines() if line.startswith("hybrid-train:")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_an_output_path_that_is_a_file_is_refused_before_loading_a_model(tmp_path, tiny_teacher_dir, tiny_mask,
                                                                           capsys, no_model_load):
    out = tmp_path / "out"
    out.write_text("not a folder")
    cfg = write_toml(tmp_path / "run.toml", out, tiny_teacher_dir, tiny_mask)
    assert main(["--config", str(cfg)]) == 2
    err = error_line(capsys)
    assert "is an existing file" in err and "--out DIR" in err


def test_a_read_only_output_folder_is_refused_before_loading_a_model(tmp_path, tiny_teacher_dir, tiny_mask, capsys,
                                                                      no_model_load):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("this user (root) can write a 0o555 folder")
        cfg = write_toml(tmp_path / "run.toml", ro / "out", tiny_teacher_dir, tiny_mask)
        assert main(["--config", str(cfg)]) == 2
        err = error_line(capsys)
        assert "not writable" in err and str(ro) in err and "--out DIR" in err
        cfg = write_toml(tmp_path / "run.toml", ro, tiny_teacher_dir, tiny_mask)  # the folder itself
        assert main(["--config", str(cfg)]) == 2
        assert "output folder is not writable" in error_line(capsys)
    finally:
        ro.chmod(0o755)


def test_an_unwritable_output_folder_is_named_even_as_root(tmp_path, tiny_teacher_dir, tiny_mask, capsys,
                                                         monkeypatch, no_model_load):
    """The check above, with a folder this process cannot write simulated (root can write a 0o555 one)."""
    import hybrid.train.checkpoint as ckmod

    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(ckmod.os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    cfg = write_toml(tmp_path / "run.toml", ro / "a" / "out", tiny_teacher_dir, tiny_mask)
    assert main(["--config", str(cfg)]) == 2
    err = error_line(capsys)
    assert f"the output folder's parent {ro}" in err and "not writable" in err and "--out DIR" in err
    assert not (ro / "a").exists()


@pytest.mark.parametrize("how", ["flag", "config"])
def test_cuda_without_a_gpu_is_refused_naming_the_fix(tmp_path, tiny_teacher_dir, tiny_mask, capsys, monkeypatch,
                                                      no_model_load, how):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = write_toml(tmp_path / "run.toml", tmp_path / "out", tiny_teacher_dir, tiny_mask)
    if how == "config":
        cfg.write_text(cfg.read_text().replace('device = "cpu"', 'device = "cuda"'))
    argv = ["--config", str(cfg)] + (["--device", "cuda"] if how == "flag" else [])
    assert main(argv) == 2
    err = error_line(capsys)
    assert "no CUDA GPU" in err and "--device cpu" in err and "auto" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["", "a few words only"])
def test_a_corpus_too_short_for_one_window_is_refused_before_the_run_folder_is_made(tmp_path, tiny_teacher_dir,
                                                                                   tiny_mask, capsys, text):
    corpus = tmp_path / "small.txt"
    corpus.write_text(text)
    out = tmp_path / "runs" / "out"
    cfg = write_toml(tmp_path / "run.toml", out, tiny_teacher_dir, tiny_mask)
    cfg.write_text(cfg.read_text().replace("[data]\n", f'[data]\ncorpus = "{corpus}"\n'))
    assert main(["--config", str(cfg)]) == 2
    err = error_line(capsys)
    assert "too short" in err and "tokens" in err and "seq_len=32" in err and "needs at least" in err
    assert "longer data.corpus" in err
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_resume_after_a_config_change_names_each_changed_field(tmp_path, tiny_teacher_dir, tiny_mask, capsys):
    cfg = write_toml(tmp_path / "run.toml", tmp_path / "out", tiny_teacher_dir, tiny_mask)
    assert main(["--config", str(cfg), "--stage", "1"]) == 0
    capsys.readouterr()
    text = cfg.read_text()
    changed = text.replace("lr = 3e-3", "lr = 1e-3", 1).replace("text = 0.5", "text = 0.6").replace(
        "threads = 1", "threads = 2")  # threads: bookkeeping, not part of the fingerprint
    cfg.write_text(changed)
    assert main(["--config", str(cfg), "--resume"]) == 2
    err = error_line(capsys)
    assert "stages[2:distill].lr: 0.003 -> 0.001" in err
    assert "data.text: 0.5 -> 0.6" in err
    assert "threads" not in err and "stages[1:align]" not in err
    assert "--allow-config-change" in err
