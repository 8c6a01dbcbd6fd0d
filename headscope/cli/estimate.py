"""The time estimate a scoring command prints before it starts, and revises after its first step."""
from __future__ import annotations

import argparse
import time

from headscope.cli.common import log, task_kwargs
from headscope.evaluate.lengths import format_seconds

# Scoring work per pair, in units of one timed forward of a head-batch (n_heads copies of the prompt) per layer:
# the fast receiver path (prefix reuse, layer skip) and one path-patching round (senders below the last receiver
# layer only). Measured as single-thread CPU time on the reference model: receivers 0.28 (NIAH, 1024 tokens) and
# 0.32 (reasoning), one sender round 0.07 (NIAH) and 0.17 (reasoning). The estimate is printed as "about".
RECEIVER_FORWARDS_PER_LAYER = 0.3
SENDER_FORWARDS_PER_LAYER = 0.1


def forward_seconds(model, ids, batch: int) -> float:
    import torch

    x = ids[None].expand(batch, -1).to(next(model.parameters()).device)  # [B, T]
    best = float("inf")
    with torch.inference_mode():
        model(input_ids=x[:1, :8])  # warm-up
        for _ in range(2):  # the faster of two: a first call's allocations are not scoring time
            t0 = time.perf_counter()
            model(input_ids=x)
            best = min(best, time.perf_counter() - t0)
    return best


def task_seconds(model, tokenizer, tasks: list[str], args: argparse.Namespace,
                 sender_rounds: int) -> dict[str, tuple[float, float]]:
    """About how long scoring takes, per task (receiver seconds, sender seconds): one timed head-batch forward
    per task, times the forwards the work needs."""
    import torch

    from headscope.arch import describe
    from headscope.tasks import get_task

    arch = describe(model)
    out: dict[str, tuple[float, float]] = {}
    for task in tasks:
        pair = get_task(task, **task_kwargs(task, args)).tokenized(tokenizer, 1, args.seed)[0]
        ids = torch.as_tensor(pair.clean_ids)  # [T]
        t_batch = forward_seconds(model, ids, arch.n_heads)
        per_layer = args.n_samples * arch.n_layers * t_batch
        out[task] = (per_layer * RECEIVER_FORWARDS_PER_LAYER, per_layer * sender_rounds * SENDER_FORWARDS_PER_LAYER)
    return out


class Estimate:
    """The time estimate of a scoring command: printed before scoring from one timed forward per task, then
    once more from the first measured step (the first task's receiver scores), which holds whatever else is
    running on the same cores."""

    def __init__(self, model, tokenizer, tasks: list[str], args: argparse.Namespace, sender_rounds: int):
        t0 = time.time()
        self.parts = task_seconds(model, tokenizer, tasks, args, sender_rounds)  # {task: (receiver s, sender s)}
        self.revised = False
        what = "receiver" + (f" + sender ({sender_rounds} rounds max)" if sender_rounds else "") + " scores"
        total = sum(r + s for r, s in self.parts.values())
        log(f"estimated time: about {format_seconds(total)} for {what} on {', '.join(tasks)} with {args.n_samples} "
            f"samples each (timed in {time.time() - t0:.1f}s on the cores as they are now; re-estimated after the "
            "first step; Ctrl-C stops)")

    def first_step(self, task: str, seconds: float) -> None:
        """After the first task's receiver scores took ``seconds``: the rest, scaled by measured / estimated."""
        if self.revised:
            return
        self.revised = True
        est = self.parts[task][0]
        rest = sum(r + s for r, s in self.parts.values()) - est
        if rest <= 0 or est <= 0:
            return
        ratio = seconds / est
        log(f"re-estimated from the first step ({task} receiver scores: {seconds:.1f}s, estimated {est:.1f}s): "
            f"about {format_seconds(rest * ratio)} left")


