"""Count the aten ops (~ GPU kernels) of one decode step (T = 1 per row), per layer, teacher vs 7:1 hybrid (CPU).

A decode step on the GPU is bound by the number of kernels it launches (each ~2-4 us even replayed from a CUDA
graph, 28 layers), not by bytes, so this counts them on a tiny model of the same structure as
research/bench_whole_model_gpu.py's: GQA, the hybrid's FA heads whole KV groups, GDN heads, merge "norm",
fa_gate "sigmoid2", log-length scale, the GDN prologue; hybrid.decoding.Decoder on a StaticHybridCache.

Counting is research.perf.op_count's (a TorchDispatchMode; calls that are fused kernels on CUDA count as their kernels,
views and allocations not at all); ops of once-per-step work done inside a layer (the log scale, cached for the
other layers) are averaged over the layers. The tiny model is bf16 (--dtype), as on the GPU, so casts count.

    PYTHONPATH=$PWD python research/count_decode_ops.py            # batch 1 and 8: per layer, by op name
    PYTHONPATH=$PWD python research/count_decode_ops.py --context 64
"""
from __future__ import annotations

import argparse

import torch

from research.perf.op_count import count_step, summarize


def tiny_teacher(layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """A Qwen3-shaped tiny teacher (GQA 4 q / 2 KV heads of 16), bf16 by default (the GPU benchmark's dtype, so
    half-type casts are counted)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=dtype).eval()


def build(teacher, name: str):
    """"teacher" (every head FA with RoPE) or "hybrid" (per layer one whole KV group FA, the rest GDN)."""
    from headscope.heads import Head
    from headscope.mask import HeadMask
    from hybrid.builders import from_teacher
    from hybrid.convert import from_mask

    if name == "teacher":
        return from_teacher(teacher).eval()
    cfg = teacher.config
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    fa = [Head(layer=l, head=(l % cfg.num_key_value_heads) * rep + r)
          for l in range(cfg.num_hidden_layers) for r in range(rep)]
    return from_mask(teacher, HeadMask.for_model(teacher, fa)).eval()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    args = ap.parse_args(argv)
    teacher = tiny_teacher(dtype=getattr(torch, args.dtype))
    res = {}
    for name, batch in ((n, b) for b in args.batch for n in ("teacher", "hybrid")):
        s = summarize(count_step(build(teacher, name), batch, args.context))
        res[(name, batch)] = s
        print(f"== {name}, batch {batch}: {s['per_layer']:g} kernel ops per layer per decode step "
              f"(+{s['per_layer_views']:g} view ops), {s['outside']} outside the layers")
        print("   per layer: " + ", ".join(f"{op} {c:g}" for op, c in s["per_layer_ops"].items()))
        print("   outside:   " + ", ".join(f"{op} {c:g}" for op, c in s["outside_ops"].items()))
    return res


if __name__ == "__main__":
    main()
