"""Benchmark one head-level hybrid attention layer against its branches and 16-head full attention (GPU).

Layer: hidden 2048, 16 query heads x 128 (8 KV heads), bf16, 7:1 (2 FA heads + 14 GDN heads), batch 1.
For T in 4K, 16K, 64K, 128K it times (medians, after warm-up):
- hybrid layer forward, and its FA branch and GDN branch alone in the same run (target: hybrid <= 1.15 x sum);
- the 16-head full-attention layer (teacher-like: RoPE, SDPA/flash, same projections) forward and fwd+bwd
  (targets at 128K: forward >= 5x, forward+backward >= 8x slower than the hybrid);
- the decode cache bytes at 128K: hybrid (FA KV of the FA heads' KV heads + GDN state) vs full attention.

Run (on the GPU machine, fla optional but expected for the GDN chunk kernel):
    pip install --no-deps <fla wheel> ;  python experiments/bench_hybrid_layer_gpu.py [--lengths 4096 16384]
Writes $OUT/bench_hybrid_layer.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from hybrid.cache import cache_nbytes
from hybrid.config import HybridConfig
from hybrid.layers.common import RotaryEmbedding
from hybrid.layers.hybrid_attention import HybridAttention

H, K, D, C = 16, 8, 128, 2048
FA_HEADS = [3, 12]  # 2 FA heads reading 2 different KV heads (the harder case for the cache)


def layer_config(fa_heads: list[int], **options) -> HybridConfig:
    return HybridConfig(vocab_size=256, hidden_size=C, intermediate_size=4 * C, num_hidden_layers=1,
                        num_attention_heads=H, num_key_value_heads=K, head_dim=D, qk_norm=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, fa_heads=[fa_heads],
                        hybrid=options)


def bench(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench when available, else CUDA events)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup * 25, rep=reps * 25, return_mode="median"))
    except ImportError:
        pass
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def fwd_bwd(layer, x, args):
    def run():
        x.grad = None
        out = layer(x, *args)  # [B, T, C]
        out.backward(torch.ones_like(out))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    ap.add_argument("--no-backward", action="store_true", help="skip forward+backward timings")
    ap.add_argument("--gdn-backend", default="auto")
    ap.add_argument("--attn-backend", default="auto")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    from hybrid.ops import fla_available

    has_fla = fla_available()
    if not has_fla:
        print("WARNING: fla is not importable: the GDN branch runs the PyTorch chunked fallback (slow); "
              "install the fla wheel (pip install --no-deps <wheel>) for meaningful numbers")
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    hyb_cfg = layer_config(FA_HEADS, gdn_backend=args.gdn_backend, attn_backend=args.attn_backend)
    full_cfg = layer_config(list(range(H)), allow_degenerate=True, fa_rope=True, fa_log_scale=False, fa_gate="none",
                            fusion="none", attn_backend=args.attn_backend)
    hybrid = HybridAttention(hyb_cfg, 0).to(dev, dt)
    full = HybridAttention(full_cfg, 0).to(dev, dt)  # = the teacher's attention layer: RoPE, GQA, o_proj
    for m in (hybrid, full):
        for p in m.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
    rope = RotaryEmbedding(hyb_cfg)
    rows = []
    print(f"device={torch.cuda.get_device_name()} fla={has_fla} torch={torch.__version__} heads FA={FA_HEADS} "
          f"(KV {hyb_cfg.fa_kv_heads(0)}) + {len(hyb_cfg.la_heads(0))} GDN")
    for T in args.lengths:
        x = torch.randn(1, T, C, device=dev, dtype=dt) * 0.5  # [B, T, C]
        pos = torch.arange(T, device=dev)
        cos, sin = rope(pos, dt)
        fargs = (pos, cos, sin)
        with torch.no_grad():
            t_hyb = bench(lambda: hybrid(x, *fargs))
            t_fa = bench(lambda: hybrid.fa(x, pos, cos, sin, None))
            t_la = bench(lambda: hybrid.la(x, pos, cos, sin, None))
            t_full = bench(lambda: full(x, *fargs))
        row = {"T": T, "hybrid_fwd_ms": t_hyb, "fa_branch_ms": t_fa, "gdn_branch_ms": t_la,
               "hybrid_over_branches": t_hyb / (t_fa + t_la), "full16_fwd_ms": t_full, "fwd_speedup": t_full / t_hyb}
        if not args.no_backward:
            xg = x.detach().requires_grad_(True)
            row["hybrid_fwdbwd_ms"] = bench(fwd_bwd(hybrid, xg, fargs), reps=5)
            row["full16_fwdbwd_ms"] = bench(fwd_bwd(full, xg, fargs), reps=5)
            row["fwdbwd_speedup"] = row["full16_fwdbwd_ms"] / row["hybrid_fwdbwd_ms"]
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        del x
        torch.cuda.empty_cache()

    cache = cache_nbytes(hyb_cfg, 131072, dtype=dt)
    fa_fraction = len(hyb_cfg.fa_kv_heads(0)) / K
    target = fa_fraction * cache["teacher"] + cache["gdn_state"]
    print("\nT       hybrid   FA-br   GDN-br  hyb/sum  full16   speedup  | fwd+bwd hybrid  full16  speedup")
    for r in rows:
        line = (f"{r['T']:<7} {r['hybrid_fwd_ms']:7.2f} {r['fa_branch_ms']:7.2f} {r['gdn_branch_ms']:7.2f} "
                f"{r['hybrid_over_branches']:7.2f}x {r['full16_fwd_ms']:7.2f} {r['fwd_speedup']:7.2f}x")
        if "fwdbwd_speedup" in r:
            line += f"  | {r['hybrid_fwdbwd_ms']:13.2f} {r['full16_fwdbwd_ms']:7.2f} {r['fwdbwd_speedup']:7.2f}x"
        print(line)
    print(f"\ndecode cache at 128K (one layer, bf16 KV, fp32 GDN state): hybrid {cache['total'] / 2**20:.2f} MiB "
          f"(FA KV {cache['fa_kv'] / 2**20:.2f} + GDN state {cache['gdn_state'] / 2**20:.2f}) vs full attention "
          f"{cache['teacher'] / 2**20:.2f} MiB; target <= {target / 2**20:.2f} MiB "
          f"({'met' if cache['total'] <= target else 'MISSED'})")
    last = rows[-1]
    print(f"targets at T={last['T']}: hybrid/branches {last['hybrid_over_branches']:.2f}x (<= 1.15), forward speedup "
          f"{last['fwd_speedup']:.2f}x (>= 5)" + (f", fwd+bwd speedup {last['fwdbwd_speedup']:.2f}x (>= 8)"
                                                 if "fwdbwd_speedup" in last else ""))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_hybrid_layer.json"), "w") as f:
            json.dump({"rows": rows, "cache_128k": cache, "cache_target": target, "fla": has_fla,
                       "device": torch.cuda.get_device_name(), "fa_heads": FA_HEADS}, f, indent=2)


if __name__ == "__main__":
    main()
