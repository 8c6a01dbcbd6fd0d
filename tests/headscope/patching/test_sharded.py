"""Sharded scoring (headscope.patching.sharded): heads or samples split over torch.distributed processes give the
scores of one process; a subset of heads per backend; the errors."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headscope.heads import Head
from headscope.metrics import resolve_metric
from headscope.cli import main
from headscope.mask import HeadMask
from headscope.patching import HFBackend, HFFastConfig, NaiveBackend, receiver_scores
from headscope.patching.hf import by_layer
from headscope.patching.path import HFPathBackend, NaivePathBackend
from headscope.patching.sharded import Shard, resolve_shard, shard_heads, supports_heads
from headscope.results import HeadScores
from headscope.senders import _score_senders

from sharded_worker import RECEIVERS, model_and_pairs

pytestmark = pytest.mark.usefixtures("one_thread")
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
METRIC = resolve_metric("logit_diff")


def one_process(backend, pairs):
    return receiver_scores(backend, pairs, METRIC, progress=False, on_clean_failure="warn",
                           min_clean_accuracy=0.0).per_sample_raw  # [N, L, H]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shard_heads_partition_every_head_once_and_balance_layers(world):
    L, H = 4, 6
    parts = [shard_heads(L, H, r, world) for r in range(world)]
    flat = [h for p in parts for h in p]
    assert sorted(flat) == [Head(l, h) for l in range(L) for h in range(H)] and len(set(flat)) == L * H
    for p in parts:  # every rank: within one head of the others in every layer
        counts = [sum(1 for h in p if h.layer == l) for l in range(L)]
        assert max(counts) - min(counts) <= 1 and abs(len(p) - L * H / world) < L


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("make", [lambda m: NaiveBackend(m), lambda m: HFBackend(m, HFFastConfig(batch_size=None)),
                                  lambda m: HFBackend(m, HFFastConfig(batch_size=3)),
                                  lambda m: NaivePathBackend(m, RECEIVERS), lambda m: HFPathBackend(m, RECEIVERS)],
                         ids=["naive", "hf", "hf-b3", "naive-path", "hf-path"])
def test_a_subset_of_heads_computes_those_entries_as_the_full_run(make):
    model, pairs = model_and_pairs(1)
    backend = make(model)
    assert supports_heads(backend)
    full = backend.patched_metrics(pairs[0], METRIC)  # [L, H]
    subset = [Head(2, 1), Head(0, 3), Head(1, 0), Head(1, 2)]
    part = backend.patched_metrics(pairs[0], METRIC, heads=subset)  # [L, H]
    for h in subset:
        assert part[h.layer, h.head] == pytest.approx(float(full[h.layer, h.head]), abs=1e-5)
    with pytest.raises(ValueError, match="outside this model"):
        backend.patched_metrics(pairs[0], METRIC, heads=[Head(9, 0)])


def test_by_layer_groups_when_a_batch_holds_a_layer():
    jobs = [(0, 0), (0, 2), (1, 1), (1, 3), (2, 0)]
    assert by_layer(jobs, 2) == [[(0, 0), (0, 2)], [(1, 1), (1, 3)], [(2, 0)]]
    assert by_layer(jobs, 1) == [jobs]


def test_errors_name_the_problem_and_the_fix():
    with pytest.raises(RuntimeError, match="torchrun"):
        resolve_shard("heads", 4)  # no process group here
    with pytest.raises(ValueError, match="shard='rows'"):
        resolve_shard("rows", 4)
    assert resolve_shard(None, 4) is None
    with pytest.raises(ValueError, match="Shard.mode"):
        Shard(0, 2, "auto")
    with pytest.raises(ValueError, match="Shard.rank"):
        Shard(2, 2, "heads")
    model, pairs = model_and_pairs(1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        receiver_scores(HFBackend(model), pairs, METRIC, progress=False, min_clean_accuracy=0.0, shard="auto")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The worker's results from 2 gloo processes (one torchrun call, ~20 s on 2 shared cores)."""
    out = tmp_path_factory.mktemp("sharded")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), str(HERE)])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(HERE / "sharded_worker.py"), str(out)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.filterwarnings("ignore")
def test_two_processes_give_one_process_scores_on_every_rank(two_ranks):
    model, pairs3 = model_and_pairs(3)
    _, pairs4 = model_and_pairs(4)
    ref3 = one_process(HFBackend(model), pairs3)
    ref4 = one_process(HFBackend(model), pairs4)
    ref_naive = one_process(NaiveBackend(model), pairs3[:1])
    ref_send = _score_senders(model, __import__("headscope.arch", fromlist=["describe"]).describe(model), pairs3,
                              RECEIVERS, METRIC, "hf", None, False, "custom", "warn", 0.0, {}).per_sample_raw
    assert ref3.abs().max() > 0.1 and ref_send.abs().max() > 0.01  # the patching does something
    for res in two_ranks:  # every rank holds the gathered scores
        for name in ("hf_heads", "hf_heads_b3", "hf_auto3"):
            assert res[name]["world"] == 2
            torch.testing.assert_close(res[name]["raw"], ref3, atol=1e-5, rtol=0)  # other batches: float32 rounding
        assert res["hf_auto3"]["mode"] == "heads"  # 3 pairs do not divide over 2 ranks
        assert res["hf_samples"]["mode"] == "samples"
        assert torch.equal(res["hf_samples"]["raw"], ref4)  # the same batches as one process: the same bits
        assert res["naive_heads"]["mode"] == "heads"
        assert torch.equal(res["naive_heads"]["raw"], ref_naive)  # one forward per head either way
        assert res["senders_heads"]["mode"] == "heads"
        torch.testing.assert_close(res["senders_heads"]["raw"], ref_send, atol=1e-5, rtol=0)
        assert "rank(s) [1] built other pairs than rank 0" in res["mismatch"]
    assert torch.equal(two_ranks[0]["hf_heads"]["raw"], two_ranks[1]["hf_heads"]["raw"])


@pytest.mark.slow  # ~30 s: torchrun starts 2 processes that load the model and score (the engine's 2-rank test is fast)
@pytest.mark.filterwarnings("ignore:the model answers only:UserWarning")  # a random tiny model fails NIAH
def test_cli_shard_under_torchrun_writes_what_one_process_writes(tmp_path, model_dir, capsys):
    common = ["--model", str(model_dir), "--n-samples", "3", "--context-length", "64", "--quiet", "--quick", "--k",
              "3"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["run", *common, "--device", "cpu", "--shard", "heads", "--out", str(one / "mask.json"),
                 "--save-scores", str(one / "scores")]) == 0
    assert "one process (not started by torchrun): nothing to split" in capsys.readouterr().err
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "headscope", "run", *common, "--shard", "heads", "--out", str(two / "mask.json"),
                           "--save-scores", str(two / "scores")], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("wrote ") >= 2 and "2 processes (gloo)" in proc.stderr  # rank 0 alone logs
    a, b = HeadScores.from_json(one / "scores" / "niah.json"), HeadScores.from_json(two / "scores" / "niah.json")
    torch.testing.assert_close(b.per_sample_raw, a.per_sample_raw, atol=1e-5, rtol=0)
    assert b.settings["shard"] == "heads" and b.settings["world_size"] == 2 and "shard" not in a.settings
    assert HeadMask.from_json(two / "mask.json").fa_heads == HeadMask.from_json(one / "mask.json").fa_heads


@pytest.mark.parametrize("finished", [True, False])
def test_end_process_group_ends_a_running_group_and_is_a_no_op_without_one(tmp_path, finished):
    """The last step of hybrid-train and of headscope's --shard under torchrun: the process group ends (after a
    barrier when every rank finished; without one after an error, where a barrier could wait on a rank that did not
    fail); nothing to do without one."""
    import torch.distributed as dist

    from headscope.patching.sharded import end_process_group

    end_process_group(finished)  # no group: nothing happens
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        end_process_group(finished)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
