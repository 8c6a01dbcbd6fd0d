"""Shared test helpers for tests/hybrid: one `assert_close` and named tolerances.

Import by plain name from any test (pyproject's pytest `pythonpath` holds tests/hybrid):
    from testing_utils import TOL, assert_close, rel_err

The error measure is fla's (tests/utils `get_err_ratio`): the RMS of the difference over the RMS of the
reference, ||x - ref||_2 / ||ref||_2, so one number per tensor that does not blow up on near-zero entries.
"""
from __future__ import annotations

import torch

# Named tolerances on rel_err (relative RMS error). Use these names, not literals, in tests.
TOL = {
    "fp64_exact": 1e-10,  # two float64 implementations of the same function (chunk vs recurrent, sdpa vs eager)
    "fp64_cancellation": 1e-7,  # float64, a quantity that is a near-total cancellation of O(1) terms (dg at huge decay)
    "fp32": 1e-5,  # two float32 implementations of the same function
    "bf16_kernel": 1e-2,  # a bf16 GPU kernel (fla, flash-attn) against a float32 reference
    "bf16_model": 3e-2,  # a whole bf16 layer/model against a float32 reference
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_2 / ||ref||_2 computed in float64 (0 when both are all zero)."""
    x, ref = x.detach().to(torch.float64), ref.detach().to(torch.float64)
    if x.shape != ref.shape:
        raise AssertionError(f"shape mismatch: {tuple(x.shape)} vs reference {tuple(ref.shape)}")
    num, den = (x - ref).norm().item(), ref.norm().item()
    if den == 0.0:
        return num
    return num / den


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float | str) -> float:
    """Assert rel_err(x, ref) <= tol (a number or a key of TOL); non-finite values always fail.
    Returns the error so tests can print or collect it."""
    tol_value = TOL[tol] if isinstance(tol, str) else float(tol)
    if not torch.isfinite(x).all():
        raise AssertionError(f"{name}: non-finite values in the tested tensor")
    err = rel_err(x, ref)
    if not err <= tol_value:
        raise AssertionError(f"{name}: relative error {err:.3e} > tolerance {tol_value:.1e} ({tol})")
    return err


def interpreter_refuses_numpy() -> bool:
    """Triton's CPU interpreter up to 3.6 turns one-element arrays into Python ints (``int(array)``), which NumPy
    2.4 refuses ("only 0-dimensional arrays can be converted"): every kernel with a loop bound read from memory
    fails there, whatever the kernel."""
    import numpy
    import triton

    major_minor = lambda v: tuple(int(x) for x in v.split(".")[:2])  # noqa: E731
    return major_minor(numpy.__version__) >= (2, 4) and major_minor(triton.__version__) <= (3, 6)


def run_in_triton_interpreter(code: str) -> None:
    """Run ``code`` in a fresh Python with TRITON_INTERPRET=1 (Triton kernels on the CPU); it must print "OK".
    Skips (with the reason) where the interpreter cannot run under this NumPy (``interpreter_refuses_numpy``)."""
    import os
    import subprocess
    import sys

    import pytest

    if interpreter_refuses_numpy():
        pytest.skip("Triton <= 3.6's CPU interpreter fails under NumPy >= 2.4 (int() of a one-element array); "
                    "run these with numpy < 2.4")

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "tests", "hybrid"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def compile_for_hopper(fn, types: dict[str, str], constexprs: dict, launch_pdl: bool = False) -> str:
    """The PTX of Triton kernel ``fn`` compiled ahead of time for sm_90 (a GPU need not be present: Triton ships
    ptxas, which also checks the PTX); ``types``: the pointer / float arguments' Triton types (others i32)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": launch_pdl})
    assert kernel.asm["cubin"]  # ptxas took it
    return kernel.asm["ptx"]
