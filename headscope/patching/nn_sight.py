"""Receiver scores through nnsight (0.8): the out_proj input is edited inside a trace.

Plain full forwards; the heads of one micro-batch are batch elements, element i patching head jobs[i]
in ``<layers>[l].<attn>.<o_proj>.input  # [B, T, H*D]``. nnsight is never imported here.
"""
from __future__ import annotations

from typing import Any

import torch

from headscope.arch import describe
from headscope.metrics import Metric
from headscope.patching.engine import head_batches, model_device
from headscope.patching.inputs import PatchPair

__all__ = ["NNsightBackend", "is_nnsight_model", "unwrap_nnsight"]


def is_nnsight_model(obj: Any) -> bool:
    return any(c.__module__.startswith("nnsight") for c in type(obj).__mro__)


def unwrap_nnsight(obj: Any) -> torch.nn.Module:
    for attr in ("_module", "_model"):
        model = getattr(obj, attr, None)
        if isinstance(model, torch.nn.Module):
            return model
    raise TypeError(f"cannot find the torch model inside {type(obj).__name__} (expected ._module)")


class NNsightBackend:
    name = "nnsight"

    def __init__(self, nn_model: Any, batch_size: int | None = None):
        if not is_nnsight_model(nn_model):
            raise TypeError(f"NNsightBackend needs an nnsight model, got {type(nn_model).__name__}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.nn = nn_model
        self.hf = unwrap_nnsight(nn_model)
        self.arch = describe(self.hf)
        self.n_layers, self.n_heads, self.n_kv_heads = self.arch.n_layers, self.arch.n_heads, self.arch.n_kv_heads
        self.batch_size = batch_size or self.n_heads
        names = {id(mod): name for name, mod in self.hf.named_modules()}
        self._proj_paths = [names[id(p)] for p in self.arch.out_projs]
        self.device = model_device(self.hf)

    def _envoy(self, l: int) -> Any:
        env = self.nn
        for part in self._proj_paths[l].split("."):
            env = env[int(part)] if part.isdigit() else getattr(env, part)
        return env

    @torch.inference_mode()
    def answer_logits(self, ids: torch.Tensor, answer_pos: torch.Tensor) -> torch.Tensor:
        with self.nn.trace(ids[None].to(self.device)):
            logits = self.nn.output.logits.save()  # [1, T, V]
        return logits[0, answer_pos.to(self.device)].float()  # [A, V]

    @torch.inference_mode()
    def patched_metrics(self, pair: PatchPair, metric: Metric, pbar=None) -> torch.Tensor:
        arch = self.arch
        saved: list[Any] = []
        with self.nn.trace(pair.corrupt_ids[None].to(self.device)):
            for l in range(self.n_layers):
                saved.append(self._envoy(l).input.save())
        z_corrupt = [s.clone() for s in saved]  # [1, T, H*D] each
        out = torch.zeros(self.n_layers, self.n_heads, dtype=torch.float64)  # [L, H]
        for chunk, rows in head_batches(self.n_layers, self.n_heads, self.batch_size):
            with self.nn.trace(pair.clean_ids[None].expand(len(chunk), -1).to(self.device)):
                for l in sorted(rows):  # modules must be visited in execution order
                    z = self._envoy(l).input  # [B, T, H*D]
                    for b, h in rows[l]:
                        sl = arch.head_slice(h)
                        z[b, :, sl] = z_corrupt[l][0, :, sl]
                logits = self.nn.output.logits.save()  # [B, T, V]
            vals = metric(logits[:, pair.answer_pos.to(self.device)].float(), pair)  # [B]
            for (l, h), v in zip(chunk, vals.tolist()):
                out[l, h] = v
            if pbar is not None:
                pbar.update(len(chunk))
        return out
