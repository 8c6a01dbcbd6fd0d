"""All hybrid GPU measurements in ONE process, most important first, under a wall-clock budget.

Run (GPU machine; fla-core carried as a wheel):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
    PYTHONPATH=/tmp/site:$PWD python3 research/gpu_hybrid_all.py --budget-s 420
CPU smoke test of the logic (tiny sizes, PyTorch backends): python research/gpu_hybrid_all.py --dry-run-cpu

Every result line is printed (flushed) as soon as it exists, and $OUT/gpu_hybrid.json (./gpu_hybrid.json without
$OUT) is rewritten after every row, so a timeout keeps what was done. Units whose estimated cost no longer fits
in --budget-s are skipped and listed under "skipped". Order (each kernel shape is compiled / autotuned once, by
an untimed first call, before it is timed):
  1. parity D=128, D=64 at T=1024 (B=1, H=4): fla chunk kernel forward, backward via our dispatch and via fla's
     own backward with the Hopper guard bypassed ("unguarded"), vs the float32 PyTorch chunk reference on the same
     bf16 inputs: o, final state, dq, dk, dv, dg, dbeta, dh0; PASS <= 1e-2; HOPPER_BWD_VERIFIED_DIMS advice
  2. layer timings at 128K then 4K (B=1, bf16, hidden 2048, 16 x 128 heads, 8 KV heads, 2 FA + 14 GDN heads):
     hybrid layer, each branch alone, the branch merge alone, o_proj alone, merge + o_proj as the layer runs
     them, the 16-head full-attention layer; at 128K also the attention cores alone (16-head vs 2-head
     softmax attention + 14-head GDN kernel)
  3. fla fused_recurrent (decode) vs the float32 recurrent twin, a few steps
  4. layer timings at 16K, 64K; then parity at T=4096
  5. decode cache bytes at 128K (analytic, always)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from research.perf.benchmark import Run as _Run, bench_ms, build_layers, layer_config
from hybrid.cache import cache_nbytes
from hybrid.config import HybridConfig
from hybrid.layers.common import RotaryEmbedding
from hybrid.ops import parity
from hybrid.ops.gdn import HOPPER_BWD_ENV, fla_available, hopper_backward_guarded

TOL = 1e-2
FA_HEADS = [3, 12]  # 2 FA heads on 2 different KV heads; the other 14 heads are GDN (7:1)
TARGETS = dict(hybrid_over_branches=1.15, fwd_speedup_128k=5.0, fwdbwd_speedup_128k=8.0)


def time_into(run: Run, row: dict, key: str, fn, label: str) -> None:
    """row[key] = bench_ms(fn) rounded (NaN on CUDA out-of-memory), printed as it comes."""
    try:
        row[key] = round(bench_ms(fn, run.device), 3)
    except torch.OutOfMemoryError:
        row[key] = float("nan")
        torch.cuda.empty_cache()
    run.say(f"  {label} {key} = {row[key]} ms")


def Run(budget_s: float, path: Path, device: str) -> _Run:
    """research.perf.benchmark.Run with this script's sections."""
    return _Run(budget_s, path, device, parity=[], decode_parity=[], timings=[], targets=TARGETS)


# ---------------------------------------------------------------- 1. parity


def parity_row(run: Run, D: int, T: int, mode: str, backend: str) -> None:
    errs = parity.gdn_chunk_parity(B=1, T=T, H=4, D=D, backend=backend, device=run.device,
                                   allow_unverified_hopper_backward=mode == "unguarded")
    worst = max(errs.values())
    row = dict(kernel=backend, backward=mode, D=D, T=T, **errs, max_err=worst, ok=worst <= TOL)
    run.data["parity"].append(row)
    run.say(f"parity {backend} D={D} T={T} backward={mode}: {'PASS' if row['ok'] else 'FAIL'} max {worst:.2e}  "
            + " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    run.save()


def parity_section(run: Run, dims: list[int], lengths: list[int], modes: list[str], backend: str) -> None:
    for T in lengths:
        for D in dims:
            for mode in modes:
                est = 45.0 if T <= 1024 else 25.0  # first D: Triton compile + fla autotune of fwd and bwd
                if run.fits(f"parity D={D} T={T} {mode}", est):
                    parity_row(run, D, T, mode, backend)


def recommend(run: Run, guarded: bool) -> None:
    rows = [r for r in run.data["parity"] if r["backward"] == "unguarded"]
    if not guarded:
        msg = "fla's Hopper guard does not apply here: HOPPER_BWD_VERIFIED_DIMS is irrelevant on this machine"
    else:
        dims = sorted({r["D"] for r in rows})
        ok = [d for d in dims if all(r["ok"] for r in rows if r["D"] == d)]
        run.data["verified_dims"] = [(d, d) for d in ok]
        msg = (f"RECOMMENDATION: hybrid/ops/gdn.py HOPPER_BWD_VERIFIED_DIMS = frozenset({[(d, d) for d in ok]}) "
               f"(unguarded fla backward within {TOL} at every tested T; tested dims {dims}, T "
               f"{sorted({r['T'] for r in rows})})")
    run.data["recommendation"] = msg
    run.say(msg)
    run.save()


def decode_parity_section(run: Run, dims: list[int], backend: str) -> None:
    for D in dims:
        for T in (1, 4):
            if not run.fits(f"decode parity D={D} T={T}", 15.0):
                continue
            errs = parity.gdn_recurrent_parity(B=1, T=T, H=4, D=D, backend=backend, device=run.device)
            worst = max(errs.values())
            row = dict(kernel=backend, D=D, T=T, **errs, max_err=worst, ok=worst <= TOL)
            run.data["decode_parity"].append(row)
            run.say(f"decode {backend} D={D} steps={T}: {'PASS' if row['ok'] else 'FAIL'} "
                    + " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
            run.save()


# ---------------------------------------------------------------- 2. layer timings


def timing_row(run: Run, T: int, layers, shape: dict, dtype: torch.dtype, fallback_bwd: bool) -> None:
    hyb_cfg, hybrid, full = layers
    dev = run.device
    x = torch.randn(1, T, shape["C"], device=dev, dtype=dtype) * 0.5  # [B, T, C]
    pos = torch.arange(T, device=dev)  # [T]
    cos, sin = RotaryEmbedding(hyb_cfg)(pos, dtype)  # [T, D]
    row: dict = dict(T=T)

    def put(key: str, fn) -> None:
        time_into(run, row, key, fn, f"T={T}")

    with torch.no_grad():
        put("hybrid_fwd_ms", lambda: hybrid(x, pos, cos, sin))
        put("fa_branch_ms", lambda: hybrid.fa(x, pos, cos, sin, None))
        put("gdn_branch_ms", lambda: hybrid.la(x, pos, cos, sin, None))
        o_fa, o_la = hybrid.fa(x, pos, cos, sin, None), hybrid.la(x, pos, cos, sin, None)  # [B, T, H_F|H_L, D]
        z = hybrid.merge(x, o_fa, o_la)  # [B, T, H*D]
        # row keys fusion_ms / fusion_oproj_ms (the merge), as in the recorded results
        put("fusion_ms", lambda: hybrid.merge(x, o_fa, o_la))
        put("o_proj_ms", lambda: hybrid.o_proj(z))
        # what the layer runs after its branches: merge + o_proj in one (HeadMerge.project, no z buffer)
        put("fusion_oproj_ms", lambda: hybrid.merge.project(x, o_fa, o_la, hybrid.o_proj))
        del o_fa, o_la, z
        put("full16_fwd_ms", lambda: full(x, pos, cos, sin))
    # the layer = FA branch + GDN branch + merge + o_proj; o_proj is the teacher's and not part of the merge
    row["hybrid_over_branches"] = round(row["hybrid_fwd_ms"] / (row["fa_branch_ms"] + row["gdn_branch_ms"]), 3)
    row["hybrid_over_parts"] = round(row["hybrid_fwd_ms"] / (row["fa_branch_ms"] + row["gdn_branch_ms"]
                                                             + row["o_proj_ms"]), 3)
    row["fwd_speedup"] = round(row["full16_fwd_ms"] / row["hybrid_fwd_ms"], 2)
    xg = x.detach().requires_grad_(True)

    def fwd_bwd(layer):
        def step():
            xg.grad = None
            layer.zero_grad(set_to_none=True)
            out = layer(xg, pos, cos, sin)  # [B, T, C]
            out.backward(torch.ones_like(out))
        return step

    put("full16_fwdbwd_ms", fwd_bwd(full))
    saved = os.environ.get(HOPPER_BWD_ENV)
    try:
        os.environ[HOPPER_BWD_ENV] = "1"  # fla's own backward, guard bypassed (where it applies)
        put("hybrid_fwdbwd_ms[fla_bwd_unguarded]", fwd_bwd(hybrid))
        if fallback_bwd:
            os.environ[HOPPER_BWD_ENV] = "0"  # our default dispatch (torch-chunk recompute where guarded)
            put("hybrid_fwdbwd_ms[dispatch_default]", fwd_bwd(hybrid))
    finally:
        if saved is None:
            os.environ.pop(HOPPER_BWD_ENV, None)
        else:
            os.environ[HOPPER_BWD_ENV] = saved
    row["fwdbwd_speedup"] = round(row["full16_fwdbwd_ms"] / row["hybrid_fwdbwd_ms[fla_bwd_unguarded]"], 2)
    hybrid.zero_grad(set_to_none=True)
    full.zero_grad(set_to_none=True)
    run.data["timings"].append(row)
    line = (f"timing T={T}: hybrid fwd {row['hybrid_fwd_ms']} ms = {row['hybrid_over_parts']}x (FA branch "
            f"{row['fa_branch_ms']} + GDN branch {row['gdn_branch_ms']} + o_proj {row['o_proj_ms']}) "
            f"[target <= {TARGETS['hybrid_over_branches']}], {row['hybrid_over_branches']}x the branches alone; "
            f"merge alone {row['fusion_ms']} ms, merge + o_proj as the layer runs them {row['fusion_oproj_ms']} ms"
            f"; full16 fwd {row['full16_fwd_ms']} -> speedup {row['fwd_speedup']}x; fwd+bwd hybrid "
            f"{row['hybrid_fwdbwd_ms[fla_bwd_unguarded]']} (fla bwd, guard bypassed) vs full16 "
            f"{row['full16_fwdbwd_ms']} -> speedup {row['fwdbwd_speedup']}x")
    if fallback_bwd:
        line += f"; hybrid fwd+bwd with default dispatch {row['hybrid_fwdbwd_ms[dispatch_default]']} ms"
    if T >= 131072:
        line += (f"  [targets at 128K: fwd >= {TARGETS['fwd_speedup_128k']}x "
                 f"{'met' if row['fwd_speedup'] >= TARGETS['fwd_speedup_128k'] else 'MISSED'}, fwd+bwd >= "
                 f"{TARGETS['fwdbwd_speedup_128k']}x "
                 f"{'met' if row['fwdbwd_speedup'] >= TARGETS['fwdbwd_speedup_128k'] else 'MISSED'}]")
    run.say(line)
    run.save()
    del x, xg
    if dev == "cuda":
        torch.cuda.empty_cache()


def core_row(run: Run, T: int, shape: dict, dtype: torch.dtype, gdn_backend: str, attn_backend: str) -> None:
    """Attention cores alone, as the issue's reference figures (no projections, norms, RoPE or branch merge):
    16-head softmax attention (8 KV heads, GQA as the teacher) vs 2-head softmax attention (2 KV heads)
    plus the 14-head gated delta rule (fla chunk kernel, q/k L2-normalised in the kernel)."""
    from hybrid.ops import attention, gated_delta_rule

    dev, H, K, D = run.device, shape["H"], shape["K"], shape["D"]
    HF = len(shape["fa_heads"])
    HL = H - HF
    g = torch.Generator(device=dev).manual_seed(T)

    def rnd(*size, scale=1.0):
        return (torch.randn(*size, device=dev, dtype=dtype, generator=g) * scale).requires_grad_(True)

    q16, k8, v8 = rnd(1, T, H, D), rnd(1, T, K, D), rnd(1, T, K, D)  # [B, T, H|K, D]
    q2, k2, v2 = rnd(1, T, HF, D), rnd(1, T, HF, D), rnd(1, T, HF, D)  # [B, T, H_F, D]
    ql, kl, vl = rnd(1, T, HL, D), rnd(1, T, HL, D), rnd(1, T, HL, D)  # [B, T, H_L, D]
    gl = (-torch.rand(1, T, HL, device=dev, generator=g) * 0.1).requires_grad_(True)  # [B, T, H_L] log decay
    bl = torch.rand(1, T, HL, device=dev, dtype=dtype, generator=g).requires_grad_(True)  # [B, T, H_L]
    fa16 = lambda: attention(q16, k8, v8, causal=True, backend=attn_backend)  # noqa: E731
    fa2 = lambda: attention(q2, k2, v2, causal=True, backend=attn_backend)  # noqa: E731
    gdn = lambda: gated_delta_rule(ql, kl, vl, gl, bl, scale=D ** -0.5, use_qk_l2norm_in_kernel=True,  # noqa: E731
                                   backend=gdn_backend, allow_unverified_hopper_backward=True)[0]  # fla's bwd
    row: dict = dict(T=T)

    def put(key: str, fn) -> None:
        time_into(run, row, key, fn, f"core T={T}")

    def fb(fn):
        def step():
            o = fn()
            o.backward(torch.ones_like(o))
        return step

    with torch.no_grad():
        put("sdpa16_fwd_ms", fa16)
        put("sdpa2_fwd_ms", fa2)
        put("gdn14_fwd_ms", gdn)
    put("sdpa16_fwdbwd_ms", fb(fa16))
    put("sdpa2_fwdbwd_ms", fb(fa2))
    put("gdn14_fwdbwd_ms", fb(gdn))
    row["core_fwd_speedup"] = round(row["sdpa16_fwd_ms"] / (row["sdpa2_fwd_ms"] + row["gdn14_fwd_ms"]), 2)
    row["core_fwdbwd_speedup"] = round(row["sdpa16_fwdbwd_ms"] / (row["sdpa2_fwdbwd_ms"] + row["gdn14_fwdbwd_ms"]), 2)
    # the ceiling with a free GDN branch: 16-head attention over 2-head attention
    row["core_fwdbwd_ceiling"] = round(row["sdpa16_fwdbwd_ms"] / row["sdpa2_fwdbwd_ms"], 2)
    run.data.setdefault("cores", []).append(row)
    run.say(f"cores T={T}: 16-head attention {row['sdpa16_fwd_ms']} ms fwd / {row['sdpa16_fwdbwd_ms']} fwd+bwd; "
            f"2-head attention {row['sdpa2_fwd_ms']} / {row['sdpa2_fwdbwd_ms']}; 14-head GDN {row['gdn14_fwd_ms']} / "
            f"{row['gdn14_fwdbwd_ms']} -> fwd {row['core_fwd_speedup']}x, fwd+bwd {row['core_fwdbwd_speedup']}x "
            f"(ceiling with a free GDN branch {row['core_fwdbwd_ceiling']}x)")
    run.save()
    del q16, k8, v8, q2, k2, v2, ql, kl, vl, gl, bl
    if dev == "cuda":
        torch.cuda.empty_cache()


def timing_section(run: Run, lengths: list[int], layers, shape: dict, dtype, fallback_at: set[int], big: int) -> None:
    for T in lengths:
        est = 60.0 if T >= big else 30.0  # 128K: full attention fwd+bwd ~0.5 s per call; first T: compiles
        if run.fits(f"timing T={T}", est):
            timing_row(run, T, layers, shape, dtype, fallback_bwd=T in fallback_at)
        if T >= big and run.fits(f"cores T={T}", 20.0):
            core_row(run, T, shape, dtype, layers[0].options.gdn_backend, layers[0].options.attn_backend)


def cache_section(run: Run, cfg: HybridConfig, T: int) -> None:
    c = cache_nbytes(cfg, T, dtype=torch.bfloat16)
    row = dict(T=T, **c, ratio_full_over_hybrid=round(c["teacher"] / c["total"], 2))
    run.data["decode_cache"] = row
    run.say(f"decode cache at T={T} (one layer, bf16 KV, fp32 GDN state): hybrid {c['total'] / 2**20:.2f} MiB "
            f"(FA KV {c['fa_kv'] / 2**20:.2f} + GDN state {c['gdn_state'] / 2**20:.2f}) vs full attention "
            f"{c['teacher'] / 2**20:.2f} MiB ({row['ratio_full_over_hybrid']}x smaller)")
    run.save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget; later units are skipped")
    ap.add_argument("--timing-only", action="store_true", help="skip parity; no fallback-backward timings")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="timing lengths (default 128K 4K 16K 64K)")
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny sizes on the CPU with the PyTorch backends")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", ".")) / "gpu_hybrid.json"
    if args.dry_run_cpu:
        device, dtype, gdn_backend, attn_backend = "cpu", torch.float32, "torch_chunk", "sdpa"
        shape = dict(C=128, H=16, K=8, D=16, fa_heads=FA_HEADS)
        dims, short, long_, lengths = [16, 32], 128, 256, dict(first=[512, 64], later=[128, 256])
        big = 512
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --dry-run-cpu)")
        device, dtype, gdn_backend, attn_backend = "cuda", torch.bfloat16, "auto", "auto"
        shape = dict(C=2048, H=16, K=8, D=128, fa_heads=FA_HEADS)
        dims, short, long_ = [128, 64], 1024, 4096
        lengths, big = dict(first=[131072, 4096], later=[16384, 65536]), 131072
    if args.lengths:
        lengths = dict(first=args.lengths, later=[])
    run = Run(args.budget_s, out, device)
    env = parity.environment()
    has_fla = device == "cuda" and fla_available()
    guarded = has_fla and hopper_backward_guarded()
    run.data.update(environment=env, shape={k: v for k, v in shape.items()}, dry_run_cpu=args.dry_run_cpu)
    run.say(f"environment: {json.dumps(env)}; writing {out}")
    if device == "cuda" and not has_fla:
        run.say("WARNING: fla is not importable: parity is skipped and the GDN branch runs the PyTorch chunk "
                "fallback (slow); install the wheel (see the module docstring)")
    backend = "fla_chunk" if has_fla else "torch_chunk"
    modes = ["dispatch", "unguarded"] if guarded else ["dispatch"]

    cache_section(run, layer_config(shape["fa_heads"], shape), big)
    if (has_fla or args.dry_run_cpu) and not args.timing_only:
        parity_section(run, dims, [short], modes, backend)
        if has_fla and run.fits("fla guard check", 10.0):
            env["fla_guard_raises"] = str(parity.fla_guard_raises(B=1, H=4, D=dims[-1]))
            run.say(f"fla's Hopper guard applies: {guarded}; fla's raw backward raises: {env['fla_guard_raises']}")
        recommend(run, guarded)
    layers = build_layers(shape, device, dtype, gdn_backend, attn_backend)
    fallback_at = set() if args.timing_only else {4096, 16384} if device == "cuda" else {64, 128}
    timing_section(run, lengths["first"], layers, shape, dtype, fallback_at, big)
    if (has_fla or args.dry_run_cpu) and not args.timing_only:
        decode_parity_section(run, dims, "fla_recurrent" if has_fla else "torch_chunk")
    timing_section(run, lengths["later"], layers, shape, dtype, fallback_at, big)
    if (has_fla or args.dry_run_cpu) and not args.timing_only:
        parity_section(run, dims, [long_], modes, backend)
        recommend(run, guarded)
    bad = [r for r in run.data["parity"] + run.data["decode_parity"] if not r["ok"]]
    run.data["all_dispatch_parity_ok"] = all(r["ok"] for r in run.data["parity"] if r["backward"] == "dispatch")
    run.say(f"done: {len(run.data['parity'])} parity rows ({len(bad)} FAIL incl. decode), "
            f"{len(run.data['timings'])} timing rows, skipped {run.data['skipped'] or 'nothing'}")
    run.save()


if __name__ == "__main__":
    main()
