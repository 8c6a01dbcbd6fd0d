"""bf16 working weights with float32 masters: the student's floating parameters hold bfloat16 copies while a stage
trains, and the optimizer updates float32 master copies of them (the scheme of Megatron-LM's float16 optimizer).

Why: under autocast alone the parameters stay float32, so every Linear casts its weight to bf16 on every forward,
the embedding output and the residual stream stay float32, and the backward sums float32 activation gradients.
The H200's compiled SmolLM2 stage-2 step spent ~19% of its kernel time on such float32 adds and casts
(docs/training.md, "Batch 64, measured"). With bf16 working weights the forward and backward run in bf16 end to
end; the update itself stays exact in float32:

    backward -> grads_to_master (bf16 grads -> float32 .grad of the masters) -> clip, AdamW on the masters
             -> master_to_model (masters -> bf16 parameters)

The masters are the truth: checkpoints save them (``state_dict``), and ``close`` puts them back into the model
as float32 parameters, so a stage that ends (or a run that resumes) sees exactly the float32 values, and the
next stage starts from them. Only floating parameters of another dtype are cast; buffers are left as they are.
The model's own code decides what it computes in float32 (the hybrid layers upcast their decay parameters and
norms, hybrid/layers/common.py ``acc``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["WORKING_DTYPES", "MasterWeights", "cast_parameters"]

# TrainConfig.working_dtype -> the dtype the parameters hold while a stage trains
WORKING_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model``'s floating parameters in ``dtype``, in place; buffers stay as they are. (``model.to(dtype)`` would
    also cast the rotary ``inv_freq`` buffer, and bf16 frequencies put RoPE's angles off by radians at a few
    thousand positions: what a frozen bf16 teacher must not do.)"""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


class MasterWeights:
    """While open, ``model``'s floating parameters hold ``dtype`` copies and ``self.master[i]`` (float32, a leaf
    the optimizer updates) the value of ``self.params[i]``. Give the optimizer ``masters_for(params)``; after each
    backward call ``grads_to_master``, after each optimizer step ``master_to_model``; ``close`` ends it."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype == torch.float32:
            raise ValueError("MasterWeights(dtype=float32): the parameters are float32 already; nothing to do")
        self.model, self.dtype = model, dtype
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.master: list[torch.Tensor] = []
        self._index: dict[int, int] = {}  # id(parameter) -> its position
        with torch.no_grad():
            for name, p in model.named_parameters():  # tied parameters appear once
                if not p.is_floating_point() or p.dtype == dtype:
                    continue
                m = p.detach().clone().float()  # same shape as p, float32
                m.requires_grad_(p.requires_grad)
                if getattr(p, "_no_weight_decay", False):
                    m._no_weight_decay = True
                self._index[id(p)] = len(self.params)
                self.names.append(name)
                self.params.append(p)
                self.master.append(m)
                p.data = p.data.to(dtype)
                p.grad = None  # a working copy's gradient lives from a backward to grads_to_master only
        self.closed = False

    def masters_for(self, params: list[tuple[str, nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
        """``(name, master)`` for each trained ``(name, parameter)``, in the same order (the optimizer's groups
        and state keep the layout they have without master weights)."""
        out = []
        for name, p in params:
            i = self._index.get(id(p))
            if i is None:
                raise ValueError(f"MasterWeights: parameter {name!r} has no master (dtype {p.dtype}, not cast)")
            self.master[i].requires_grad_(True)
            out.append((name, self.master[i]))
        return out

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """Each master's .grad = its parameter's gradient in float32 (None where the parameter has none); the
        working copies' gradients are freed."""
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """The parameters = their masters rounded to the working dtype (after each optimizer step). In place on the
        parameters themselves (not ``.data``), so their version counters advance: the layers' inference caches
        (``hybrid.layers.common``: keyed by data pointer and version) see the new values."""
        torch._foreach_copy_(self.params, self.master)
        for m in self.master:
            m.grad = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the float32 masters in place of the working copies (what a checkpoint
        saves: resuming from it is exact)."""
        state = self.model.state_dict()
        where = {p.data_ptr(): i for i, p in enumerate(self.params)}  # tied parameters: every name of one tensor
        for key, v in state.items():
            i = where.get(v.data_ptr())
            if i is not None and v.shape == self.master[i].shape:
                state[key] = self.master[i].detach()
        return state

    @torch.no_grad()
    def close(self) -> None:
        """Put the masters back: the parameters are float32 again, with exactly the masters' values."""
        if self.closed:
            return
        for p, m in zip(self.params, self.master):
            p.data = m.detach().clone()
            p.grad = None
        self.closed = True
