"""Kernel-vs-reference parity measurements for the GPU (used by tests/hybrid/ops/test_gpu_kernels.py and
research/fla_parity_gpu.py). Error measure: ||x - ref||_2 / ||ref||_2 (fla's `get_err_ratio`).

The reference is the PyTorch chunked twin in float32 run on the *same* (bf16-rounded) input values, so the numbers
measure the kernel's own arithmetic, not the rounding of its inputs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

GRAD_NAMES = ("q", "k", "v", "g", "beta", "h0")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_2 / ||ref||_2 in float64 (inf if x has non-finite values)."""
    x, ref = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x).all():
        return float("inf")
    den = ref.norm().item()
    return (x - ref).norm().item() / den if den > 0 else (x - ref).norm().item()


def gdn_inputs(B: int, T: int, H: int, Dk: int, Dv: int, dtype=torch.bfloat16, device="cuda", seed: int = 0,
               gate_normalizer: float = 1.0) -> dict[str, torch.Tensor]:
    """fla's test distribution: q, k, v ~ N(0, 1) in `dtype` (q, k l2-normalised in the kernel), g = logsigmoid(U(0, 1))
    / gate_normalizer in float32, beta = sigmoid(U(0, 1)) in `dtype`, h0 ~ N(0, 1) in float32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=gen, device=device)
    return dict(
        q=torch.randn(B, T, H, Dk, **kw).to(dtype),  # [B, T, H, Dk]
        k=torch.randn(B, T, H, Dk, **kw).to(dtype),  # [B, T, H, Dk]
        v=torch.randn(B, T, H, Dv, **kw).to(dtype),  # [B, T, H, Dv]
        g=F.logsigmoid(torch.rand(B, T, H, **kw)) / gate_normalizer,  # [B, T, H] float32
        beta=torch.rand(B, T, H, **kw).sigmoid().to(dtype),  # [B, T, H]
        h0=torch.randn(B, H, Dk, Dv, **kw),  # [B, H, Dk, Dv] float32
    )


def _forward_backward(fn, x: dict, do: torch.Tensor, dht: torch.Tensor, cast=None, **kwargs):
    leaves = {n: (t.to(cast) if cast is not None else t).detach().clone().requires_grad_() for n, t in x.items()}
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["h0"],
               output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs)
    ((o.float() * do).sum() + (ht.float() * dht).sum()).backward()
    return o, ht, {n: leaves[n].grad for n in GRAD_NAMES}


def gdn_chunk_parity(B: int = 2, T: int = 1024, H: int = 4, D: int = 128, dtype=torch.bfloat16,
                     allow_unverified_hopper_backward: bool = False, gate_normalizer: float = 1.0,
                     seed: int = 0, backend: str = "fla_chunk", device: str = "cuda") -> dict[str, float]:
    """`backend` (fla_chunk, through our dispatch) vs the float32 PyTorch chunk reference: output, final state and
    all gradients. Returns {"o": err, "ht": err, "dq": err, ...}."""
    from hybrid.ops.gdn import gated_delta_rule
    from hybrid.ops.gdn_chunk import chunk_gated_delta_rule as torch_chunk

    x = gdn_inputs(B, T, H, D, D, dtype=dtype, device=device, seed=seed, gate_normalizer=gate_normalizer)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    do = torch.randn(B, T, H, D, generator=gen, device=device)  # [B, T, H, Dv]
    dht = torch.randn(B, H, D, D, generator=gen, device=device)  # [B, H, Dk, Dv]
    o, ht, grads = _forward_backward(gated_delta_rule, x, do, dht, backend=backend,
                                     allow_unverified_hopper_backward=allow_unverified_hopper_backward)
    o_ref, ht_ref, grads_ref = _forward_backward(torch_chunk, x, do, dht, cast=torch.float32)
    errs = {"o": rel_err(o, o_ref), "ht": rel_err(ht, ht_ref)}
    errs.update({f"d{n}": rel_err(grads[n], grads_ref[n]) for n in GRAD_NAMES})
    return errs


@torch.no_grad()
def gdn_recurrent_parity(B: int = 2, T: int = 1, H: int = 4, D: int = 128, dtype=torch.bfloat16,
                         seed: int = 0, backend: str = "fla_recurrent", device: str = "cuda") -> dict[str, float]:
    """`backend` (fla_recurrent, the decode kernel) vs the float32 naive twin: output and final state."""
    from hybrid.ops.gdn import gated_delta_rule
    from hybrid.ops.gdn_recurrent import recurrent_gated_delta_rule

    x = gdn_inputs(B, T, H, D, D, dtype=dtype, device=device, seed=seed)
    names = ("q", "k", "v", "g", "beta")
    kw = dict(initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, ht = gated_delta_rule(*(x[n] for n in names), **kw, backend=backend)
    o_ref, ht_ref = recurrent_gated_delta_rule(*(x[n].float() for n in names), **kw)
    return {"o": rel_err(o, o_ref), "ht": rel_err(ht, ht_ref)}


def fla_guard_raises(B: int = 1, H: int = 1, D: int = 64) -> bool:
    """Whether fla's own chunk backward (no bypass) raises its Hopper/Triton guard on this machine. Pass the
    (B, H, D) of a shape already run so fla's autotuned kernels are reused instead of tuned again."""
    from hybrid.ops.gdn import _fla_chunk_raw

    x = gdn_inputs(B, 64, H, D, D)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    o, _ = _fla_chunk_raw(*leaves, None, None, False, False, 64)
    try:
        o.float().sum().backward()
    except RuntimeError as err:
        if "640" in str(err):
            return True
        raise
    return False


def environment() -> dict[str, str]:
    """Versions and device facts that decide which path the dispatch takes."""
    import importlib.metadata as md

    from hybrid.ops.gdn import fla_available, hopper_backward_guarded

    info = {"torch": torch.__version__, "cuda_available": str(torch.cuda.is_available())}
    for pkg in ("triton", "fla-core", "flash-attn"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = "not installed"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    info["fla_importable"] = str(fla_available())
    info["hopper_backward_guarded"] = str(fla_available() and hopper_backward_guarded())
    return info
