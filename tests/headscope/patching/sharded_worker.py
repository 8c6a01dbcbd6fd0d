"""Run under torchrun (2 gloo processes) by test_sharded.py: sharded receiver and sender scores of a tiny model.

    torchrun --standalone --nproc_per_node 2 sharded_worker.py OUT_DIR     # PYTHONPATH: tests, tests/headscope/patching

Each rank writes OUT_DIR/rank{r}.pt: {scenario: per_sample_raw [N, L, H] or an error message}.
"""
import sys

import torch
import torch.distributed as dist

from headscope.heads import Head
from headscope.metrics import resolve_metric
from headscope.patching import HFBackend, HFFastConfig, NaiveBackend, as_patch_pair, receiver_scores
from headscope.senders import _score_senders  # the engine sender_scores calls, without task prompts

from model_factories import tiny_model
from patching_pairs import model_pair

RECEIVERS = [Head(1, 3), Head(2, 1)]


def model_and_pairs(n: int, seed0: int = 0):
    model = tiny_model("qwen3", initializer_range=0.2)
    T = 20
    pairs = [as_patch_pair(model_pair(model, T, fd, 2, seed=seed0 + i, max_effect=True))
             for i, fd in zip(range(n), [0, 7, 12, 3, 9])]
    return model, pairs


def raw(backend, pairs, shard):
    s = receiver_scores(backend, pairs, resolve_metric("logit_diff"), progress=False, on_clean_failure="warn",
                        min_clean_accuracy=0.0, shard=shard)
    return {"raw": s.per_sample_raw, "mode": s.settings.get("shard"), "world": s.settings.get("world_size")}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    res = {}
    model, pairs3 = model_and_pairs(3)
    _, pairs4 = model_and_pairs(4)
    res["hf_heads"] = raw(HFBackend(model, HFFastConfig(batch_size=None)), pairs3, "heads")
    res["hf_heads_b3"] = raw(HFBackend(model, HFFastConfig(batch_size=3)), pairs3, "heads")
    res["hf_samples"] = raw(HFBackend(model), pairs4, "samples")
    res["hf_auto3"] = raw(HFBackend(model), pairs3, "auto")
    res["naive_heads"] = raw(NaiveBackend(model), pairs3[:1], "heads")
    from headscope.arch import describe

    sender = _score_senders(model, describe(model), pairs3, RECEIVERS, resolve_metric("logit_diff"), "hf", None,
                            False, "custom", "warn", 0.0, {}, shard="heads")
    res["senders_heads"] = {"raw": sender.per_sample_raw, "mode": sender.settings.get("shard")}
    # rank 1 builds other pairs: both ranks must stop with the same clear error
    _, other = model_and_pairs(3, seed0=0 if rank == 0 else 10)
    try:
        raw(HFBackend(model), other, "heads")
        res["mismatch"] = "no error"
    except RuntimeError as err:
        res["mismatch"] = str(err)
    torch.save(res, f"{out}/rank{rank}.pt")
    dist.barrier()  # both ranks leave together (a rank's exit mid-collective aborted the other once: flaky in CI)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
