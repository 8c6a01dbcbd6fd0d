"""Stage 2's loss, naive vs fused (hybrid.train.fused_loss): lm_head + KL(teacher || student, tau) + weighted CE,
forward and backward, time and peak memory side by side in one run.

    python research/bench_fused_loss.py                      # SmolLM2-135M: V 49152, C 576, B 16, T 2048 (GPU)
    python research/bench_fused_loss.py --cpu-small          # B 2, T 256 on CPU (time only)
    python research/bench_fused_loss.py --chunks 1024 2048 4096 --B 32
    python research/bench_fused_loss.py --B 64 --chunks 2048 8192 --compare-f32-matmul --compare-math --skip-naive
        # the batch-64 step's loss: float32-output matmuls on/off x compiled / eager chunk math, side by side

"naive" = the stage's old path: student and teacher logits [B, T, V] (lm_head under autocast), losses.kl_div and
losses.weighted_ce on them, backward. "fused c" = fused_distill_loss with chunk_tokens c. Each row: median seconds of
forward + backward over --repeat calls (after one warm-up), the peak memory allocated during one call above what the
inputs held (torch.cuda.max_memory_allocated; CPU: not measured), and the relative error of the loss and of the
gradients w.r.t. h_s and w_s against the naive path. On CUDA the matmuls run under bf16 autocast (as the trainer);
on CPU in float32. An out-of-memory row is reported as such and the others still run. Writes $OUT/bench_fused_loss.json
when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from headscope.io import write_text
from hybrid.train.fused_loss import fused_distill_loss, naive_distill_loss


def make_inputs(B: int, T: int, V: int, C: int, Ct: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h_s = torch.randn(B, T, C, generator=g).to(device).requires_grad_()  # [B, T, C] float32 (residual stream)
    w_s = (torch.randn(V, C, generator=g) * C ** -0.5).to(device).requires_grad_()  # [V, C] float32 parameter
    h_t = torch.randn(B, T, Ct, generator=g).to(device)  # [B, T, Ct]
    w_t = (torch.randn(V, Ct, generator=g) * Ct ** -0.5).to(device)  # [V, Ct]
    ids = torch.randint(0, V, (B, T), generator=g).to(device)  # [B, T]
    w = (torch.rand(B, T, generator=g) * 2).to(device)  # [B, T]
    return h_s, w_s, h_t, w_t, ids, w


def loss_of(terms: dict, kl_weight: float, ce_weight: float) -> torch.Tensor:
    """The trainer's loss on one process: weight * sum / count per term."""
    weights = {"kl": kl_weight, "ce": ce_weight}
    return sum(weights[n] * total / count for n, (total, count) in terms.items())


def run_once(method: str, chunk: int, inputs, args, autocast, f32_matmul=None, math="auto"):
    h_s, w_s, h_t, w_t, ids, w = inputs
    h_s.grad = w_s.grad = None
    kl, ce = args.kl_weight > 0, args.ce_weight > 0
    with autocast:
        if method == "naive":
            terms = naive_distill_loss(h_s, w_s, h_t, w_t, ids, w, temperature=args.temperature, kl=kl, ce=ce)
        else:
            terms = fused_distill_loss(h_s, w_s, h_t, w_t, ids, w, temperature=args.temperature, kl=kl, ce=ce,
                                       chunk_tokens=chunk, f32_matmul=f32_matmul, chunk_math=math)
        loss = loss_of(terms, args.kl_weight, args.ce_weight)
    loss.backward()
    return loss.detach(), h_s.grad.detach().clone(), w_s.grad.detach().clone()


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(method: str, chunk: int, inputs, args, device, autocast, f32_matmul=None, math="auto") -> dict:
    tag = ("" if f32_matmul is None else (" f32mm" if f32_matmul else " no-f32mm")) + ("" if math == "auto" else f" {math}")
    row = {"method": method if method == "naive" else f"fused {chunk}{tag}", "chunk": chunk, "f32_matmul": f32_matmul,
           "chunk_math": math}
    try:
        result = run_once(method, chunk, inputs, args, autocast, f32_matmul, math)  # warm-up (+ the values compared)
        if method != "naive" and math != "eager":  # a compiled chunk math compiles the remainder's shape too
            run_once(method, chunk, inputs, args, autocast, f32_matmul, math)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            run_once(method, chunk, inputs, args, autocast, f32_matmul, math)
            sync(device)
            times.append(time.perf_counter() - t0)
        row["seconds"] = statistics.median(times)
        if device.type == "cuda":
            row["peak_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 30
        row["result"] = result
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    finally:
        for t in inputs[:2]:
            t.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--V", type=int, default=49152)
    ap.add_argument("--C", type=int, default=576, help="student hidden size")
    ap.add_argument("--Ct", type=int, default=0, help="teacher hidden size (0: C)")
    ap.add_argument("--cpu-small", action="store_true", help="B 2, T 256 on the CPU (a quick check)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--ce-weight", type=float, default=0.2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-naive", action="store_true", help="fused rows only (no errors against naive)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    ap.add_argument("--compare-f32-matmul", action="store_true",
                    help="each fused row twice, side by side: with the float32-output matmuls (f32_matmul=True) and "
                         "without (False); CUDA with a torch that has them")
    ap.add_argument("--compare-math", action="store_true",
                    help="each fused row with chunk_math 'compiled' and 'eager' side by side (default: 'auto')")
    args = ap.parse_args()
    if args.cpu_small:
        args.B, args.T, args.device = 2, 256, "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if use_cuda else nullcontext()
    Ct = args.Ct or args.C
    inputs = make_inputs(args.B, args.T, args.V, args.C, Ct, device)
    N = args.B * args.T
    print(f"device {device} ({torch.cuda.get_device_name(device) if use_cuda else 'CPU'}), "
          f"{'bf16 autocast' if use_cuda else 'float32'}; B {args.B}, T {args.T} ({N} tokens), V {args.V}, C {args.C}, "
          f"Ct {Ct}; tau {args.temperature}, kl_weight {args.kl_weight}, ce_weight {args.ce_weight}; one float32 "
          f"[B, T, V] copy = {N * args.V * 4 / 2 ** 30:.2f} GiB")
    head = f"{'method':<31}{'seconds':>10}{'peak GiB':>10}{'tok/s':>12}{'loss err':>11}{'grad_h err':>12}{'grad_W err':>12}"
    print(head)
    modes = (True, False) if args.compare_f32_matmul else (None,)
    maths = ("compiled", "eager") if args.compare_math else ("auto",)
    plan = ([] if args.skip_naive else [("naive", 0, None, "auto")])
    plan += [("fused", c, m, k) for c in args.chunks for m in modes for k in maths]
    ref, out = None, []
    for method, c, m, k in plan:  # each row printed (and the JSON written) as soon as it is measured
        r = bench(method, c, inputs, args, device, autocast, m, k)
        res = r.pop("result", None)
        if method == "naive":
            ref = res
        elif ref is not None and res is not None:
            r["loss_err"], r["grad_h_err"], r["grad_w_err"] = (rel(a, b) for a, b in zip(res, ref))
        if res is not None:
            r["loss"] = float(res[0])
        if "error" in r:
            print(f"{r['method']:<31}{r['error']:>10}")
        else:
            peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
            errs = "".join(f"{r[k]:>12.2e}" if k in r else f"{'-':>12}" for k in ("loss_err", "grad_h_err", "grad_w_err"))
            print(f"{r['method']:<31}{r['seconds']:>10.4f}{peak:>10}{N / r['seconds']:>12.0f}{errs[1:]}")
        out.append(r)
        if os.environ.get("OUT"):
            path = Path(os.environ["OUT"]) / "bench_fused_loss.json"
            write_text(path, json.dumps({"args": vars(args), "device": str(device), "rows": out}, indent=1))
    if os.environ.get("OUT"):
        print(f"wrote {Path(os.environ['OUT']) / 'bench_fused_loss.json'}")


if __name__ == "__main__":
    main()
