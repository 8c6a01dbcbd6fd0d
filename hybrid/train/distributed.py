"""torch.distributed set-up: one code path for one process (CPU or GPU) and for ``torchrun`` (DDP / FSDP).

    torchrun --nproc_per_node 2 -m hybrid.train.cli --config FILE        # gloo on CPU, NCCL on GPUs

Each process builds only its rows of the global batch (``hybrid.train.data.rank_rows``); losses divide by
global counts (all-reduced), and DDP averages gradients, so the loss equals one process's on the same batch.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["DistEnv", "setup", "wrap", "all_reduce_sum"]


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mode: str = "none"  # "none" | "ddp" | "fsdp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()  # fp32 on CPU


def setup(device: str = "auto", distributed: str = "auto") -> DistEnv:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and start the process group if needed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but no CUDA GPU is visible; use device='cpu' or 'auto'")
    dev = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    mode = "none"
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo")
        mode = "ddp" if distributed in ("auto", "ddp") else "fsdp"
    elif distributed == "fsdp":
        mode = "none"  # one process: nothing to shard
    return DistEnv(rank, world, local, dev, mode)


def wrap(model: nn.Module, env: DistEnv) -> nn.Module:
    """The module the loss calls: the model itself (one process), DDP around it, or (FSDP) the model sharded
    in place (``shard`` already did it)."""
    if env.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    return model


def shard(model: nn.Module, env: DistEnv) -> nn.Module:
    """FSDP2 (``fully_shard``) per decoder layer, then the whole model; in place. No-op unless mode is fsdp."""
    if env.mode != "fsdp":
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.world > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
