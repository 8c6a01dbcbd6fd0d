"""Head scoring sharded over the processes of ``torch.distributed``: heads or samples split across ranks.

    torchrun --nproc_per_node 2 -m headscope score --model default --task niah --shard heads --out s.json

    # in Python, inside a torchrun script (NCCL on GPUs, gloo on CPUs):
    torch.distributed.init_process_group()            # or headscope.patching.sharded.init_from_env()
    s = headscope.score(model, "niah", shard="heads")  # every rank returns the same, gathered HeadScores

Every rank builds the same pairs (same task, seed and model; checked: a rank with other pairs is an error). The
clean check (clean and corrupted metrics, greedy correctness) is split by pairs and summed over ranks, so every
rank holds the same numbers and drops the same pairs. Then each rank computes its share of the patched runs:

- ``"heads"``: every pair, a slice of the heads (``shard_heads``: interleaved over (layer, head), so every rank
  gets the same number of heads in every layer, and the fast backend's cost per head, which falls with the
  layer, is balanced too). The backend's ``patched_metrics`` takes ``heads=`` (NaiveBackend, HFBackend and
  the path-patching backends do; TransformerLens and nnsight do not: use "samples" there).
- ``"samples"``: every head, a slice of the pairs (``keep[rank::world]``). The same batches as one process, so
  the same numbers to the bit; it balances only when the pairs divide evenly.
- ``"auto"``: "samples" when the scored pairs divide evenly over the ranks, else "heads".

The raw patched metrics are summed over ranks (``all_reduce``; each entry is computed by exactly one rank, the
others add exact zeros) before normalization, so every rank ends with the full ``[N, L, H]`` scores.
"""
from __future__ import annotations

import hashlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from headscope.heads import Head

__all__ = ["Shard", "SHARD_MODES", "resolve_shard", "shard_heads", "work_share", "init_from_env",
           "end_process_group", "is_main_process"]

SHARD_MODES = ("heads", "samples", "auto")


@dataclass(frozen=True)
class Shard:
    """This process's part of a sharded scoring run."""

    rank: int
    world: int
    mode: str  # "heads" | "samples" ("auto" is resolved before a Shard is made)

    def __post_init__(self) -> None:
        if self.mode not in ("heads", "samples"):
            raise ValueError(f"Shard.mode={self.mode!r}; use 'heads' or 'samples'")
        if not (isinstance(self.world, int) and self.world >= 1):
            raise ValueError(f"Shard.world={self.world!r} must be an int >= 1")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world):
            raise ValueError(f"Shard.rank={self.rank!r} must be in 0..{self.world - 1}")


def _group_running() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_from_env(device: Any = None) -> bool:
    """Start the process group from torchrun's environment (WORLD_SIZE, RANK, ...) when there is one and it is
    not started yet: NCCL when ``device`` is a CUDA device, else gloo. Returns whether a group of > 1 process
    is running."""
    if _group_running():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if cuda else "gloo")
    return True


def end_process_group(finished: bool = True) -> None:
    """End this process's process group, if one is running (a command line's last step under ``torchrun``).
    ``finished``: every rank got here (a barrier first, so no rank's exit closes the connections of a collective
    another rank is still in); after an error only the group is destroyed (a barrier could wait forever on a rank
    that did not fail)."""
    if not _group_running():
        return
    if finished:
        dist.barrier()
    dist.destroy_process_group()


def is_main_process() -> bool:
    """True on rank 0, and in a process that is not part of a group."""
    return not _group_running() or dist.get_rank() == 0


def resolve_shard(shard: str | None, n_pairs: int) -> Shard | None:
    """The Shard of this process, or None when nothing is split (shard None, or a group of one process)."""
    if shard is None:
        return None
    if shard not in SHARD_MODES:
        raise ValueError(f"shard={shard!r}; use one of {list(SHARD_MODES)} or None")
    if not _group_running():
        raise RuntimeError(f"shard={shard!r} needs torch.distributed: start the processes with torchrun "
                           "(`torchrun --nproc_per_node N ...`) and call torch.distributed.init_process_group() "
                           "(or headscope.patching.sharded.init_from_env()) before scoring; or pass shard=None")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return None
    mode = shard if shard != "auto" else ("samples" if n_pairs >= world and n_pairs % world == 0 else "heads")
    return Shard(rank=rank, world=world, mode=mode)


def shard_heads(n_layers: int, n_heads: int, rank: int, world: int) -> list[Head]:
    """This rank's heads: every ``world``-th head of the (layer, head) order, starting at ``rank``."""
    jobs = [Head(l, h) for l in range(n_layers) for h in range(n_heads)]
    return jobs[rank::world]


def work_share(sharding: Shard | None, n_pairs: int, n_layers: int, n_heads: int
               ) -> tuple[list[int], list[Head] | None]:
    """This process's patched runs: (indices of the pairs it scores, the heads it scores or None for all)."""
    if sharding is None:
        return list(range(n_pairs)), None
    if sharding.mode == "samples":
        return list(range(sharding.rank, n_pairs, sharding.world)), None
    return list(range(n_pairs)), shard_heads(n_layers, n_heads, sharding.rank, sharding.world)


def supports_heads(backend: Any) -> bool:
    """Whether ``backend.patched_metrics`` computes a subset of heads (a ``heads=`` parameter)."""
    try:
        return "heads" in inspect.signature(backend.patched_metrics).parameters
    except (TypeError, ValueError):
        return False


def _comm_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks (a new CPU tensor of x's dtype)."""
    y = x.to(_comm_device())
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y.cpu()


def pairs_digest(pairs: Sequence[Any]) -> int:
    """A 63-bit digest of the pairs' token ids and answer positions (equal pairs, equal digest)."""
    h = hashlib.sha256()
    for p in pairs:
        for t in (p.clean_ids, p.corrupt_ids, p.answer_pos, p.clean_answer_ids, p.corrupt_answer_ids):
            h.update(torch.as_tensor(t).to(torch.int64).cpu().numpy().tobytes())
            h.update(b"|")
    return int.from_bytes(h.digest()[:8], "little") >> 1


def check_same_pairs(pairs: Sequence[Any], task: str) -> None:
    """Raise on every rank when the ranks do not hold the same pairs."""
    mine = torch.tensor([pairs_digest(pairs)], dtype=torch.int64)  # [1]
    gathered = [torch.zeros_like(mine).to(_comm_device()) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine.to(_comm_device()))
    digests = [int(g.item()) for g in gathered]
    if len(set(digests)) > 1:
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(f"sharded scoring of task {task!r}: rank(s) {bad} built other pairs than rank 0 "
                           "(different task options, seed, tokenizer or model?). Fix: give every rank the same "
                           "model, task, n_samples and seed")
