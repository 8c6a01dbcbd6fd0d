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
    PYTHONPATH=$PWD python research/count_decode_ops.py --breaks                    # where torch.compile breaks
    PYTHONPATH=$PWD python research/count_decode_ops.py --device cuda               # CUDA kernels (torch.profiler)
    PYTHONPATH=$PWD python research/count_decode_ops.py --device cuda --compile     # eager vs compiled step
    PYTHONPATH=$PWD python research/count_decode_ops.py --device cuda --compile --fused-gdn   # + the fused GDN op
    PYTHONPATH=$PWD python research/count_decode_ops.py --device cuda --compile --fused-gdn --shape bench  # its widths

``--device cuda`` counts the kernels a step launches on the GPU (research.perf.op_count.count_cuda_kernels):
per layer for the eager step (by kernel name), and the totals per step of the eager step, the CUDA-graph replay,
and with ``--compile`` the compiled step and its replay (``Decoder(compile=True)``), divided by the layers, with
the compiled step's kernels by name (inductor's fused kernels included); ``--fused-gdn`` adds the hybrid with the
fused GDN decode op (``hybrid_fused``). A compiled step has no per-layer scopes, and its ``per_layer`` (total /
layers) carries the kernels outside the layers divided among the tiny model's two: so ``--compile`` also counts the
same model one layer deeper, and the difference is one layer's kernels (``per_layer_marginal``; the rest
``outside``), what a 28-layer model's step pays per layer.
``--times STEPS`` adds where each step's time goes: the kernels' time per step by name (profiled) against the
step timed over STEPS steps without the profiler, the difference being time no kernel ran (launch gaps, the host);
with ``--shape bench --context 32768`` that is one layer of the benchmark's model at its context, e.g.
``--device cuda --compile --fused-gdn --shape bench --batch 1 --context 32768 --times 50``.
``--inductor KEY=VALUE`` (repeatable, with ``--compile``) sets inductor's settings for the compiled step
(``Decoder(compile_options=...)``), e.g. ``--inductor combo_kernels=true``: independent small kernels of the step
launched as one, which the per-layer count shows.
``--pdl`` counts and times every step with programmatic dependent launch (``Decoder(pdl=True)``): the same kernels,
so the same counts; with ``--times`` the time no kernel runs is what it can shorten.
``--gemv`` counts and times every model with its projections as the project's decode GEMV kernel
(``hybrid.layers.common.use_decode_gemv``), the teacher's too.
``--layers`` sets the tiny model's depth; ``--json`` writes the numbers.
"""
from __future__ import annotations

import argparse
import json

import torch

from headscope.io import write_text
from research.bench_whole_model_gpu import GPU_SHAPE
from research.perf.benchmark import inductor_options
from research.perf.op_count import count_cuda_kernels, count_step, graph_breaks, summarize


SHAPES = {  # the layer's widths: hidden C, MLP I, query heads H, KV heads K, head dim D
    "tiny": dict(C=64, I=128, H=4, K=2, D=16),
    "bench": {k: GPU_SHAPE[k] for k in "CIHKD"},  # the whole-model benchmark's layer
}


def tiny_teacher(layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.bfloat16, shape: str = "tiny",
                 positions: int = 4096):
    """A Qwen3-shaped teacher of a few layers, bf16 by default (the GPU benchmark's dtype, so half-type casts are
    counted). ``shape``: "tiny" (GQA 4 q / 2 KV heads of 16) or "bench" (the whole-model benchmark's layer: 16 q / 8
    KV heads of 128, hidden 2048, MLP 6144), so that the GEMMs take the library paths the 28-layer model's take; the
    vocabulary stays 128 (the head's GEMM is outside the layers). ``positions``: its max_position_embeddings (at least
    the context a count runs at)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: expected one of {', '.join(SHAPES)}")
    w = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=128, hidden_size=w["C"], intermediate_size=w["I"], num_hidden_layers=layers,
                      num_attention_heads=w["H"], num_key_value_heads=w["K"], head_dim=w["D"],
                      max_position_embeddings=positions, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=dtype).eval()


def build(teacher, name: str):
    """"teacher" (every head FA with RoPE), "hybrid" (per layer one whole KV group FA, the rest GDN) or
    "hybrid_fused" (the same with the fused GDN decode op on)."""
    from headscope.heads import Head
    from headscope.mask import HeadMask
    from hybrid.builders import from_teacher
    from hybrid.convert import from_mask

    if name == "teacher":
        return from_teacher(teacher).eval()
    if name not in ("hybrid", "hybrid_fused"):
        raise ValueError(f"model {name!r}: expected 'teacher', 'hybrid' or 'hybrid_fused'")
    cfg = teacher.config
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    fa = [Head(layer=l, head=(l % cfg.num_key_value_heads) * rep + r)
          for l in range(cfg.num_hidden_layers) for r in range(rep)]
    model = from_mask(teacher, HeadMask.for_model(teacher, fa)).eval()
    if name == "hybrid_fused":
        from hybrid.layers.hybrid_attention import use_fused_decode

        use_fused_decode(model, True)
    return model


def models(args) -> tuple[str, ...]:
    """The models a GPU count or a graph-break check covers: teacher and hybrid, and the fused one on request."""
    return ("teacher", "hybrid") + (("hybrid_fused",) if args.fused_gdn else ())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu: aten ops (default); cuda: CUDA kernels by torch.profiler")
    ap.add_argument("--compile", action="store_true", help="cuda: also count the torch.compile'd step")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode (default, max-autotune-no-cudagraphs)")
    ap.add_argument("--inductor", action="append", default=None, metavar="KEY=VALUE",
                    help="with --compile: an inductor setting for the compiled step (repeatable), e.g. "
                         "combo_kernels=true: independent small kernels launched as one")
    ap.add_argument("--pdl", action="store_true",
                    help="cuda: every counted step with programmatic dependent launch (Decoder(pdl=True); compute "
                         "capability 9.0+): the same kernels, each launched while the one before ends (see --times)")
    ap.add_argument("--gemv", action="store_true",
                    help="cuda: every model's projections as the decode GEMV kernel (use_decode_gemv), the teacher's "
                         "too")
    ap.add_argument("--breaks", action="store_true", help="print where torch.compile of the step breaks its graph")
    ap.add_argument("--fused-gdn", action="store_true",
                    help="cuda: also count the hybrid with the fused GDN decode op (hybrid_fused)")
    ap.add_argument("--layers", type=int, default=2, help="the tiny model's layers (default 2)")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                    help="the layers' widths: tiny (default) or bench, the whole-model benchmark's (its GEMMs take "
                         "the cuBLAS paths the 28-layer model's take)")
    ap.add_argument("--times", type=int, default=0, metavar="STEPS",
                    help="cuda: also where each step's time goes: kernel time per step by kernel name (profiled) "
                         "against the step timed over STEPS steps without the profiler (e.g. 50)")
    ap.add_argument("--json", default=None, help="write the results to this JSON path")
    args = ap.parse_args(argv)
    if args.inductor and not args.compile:
        ap.error("--inductor sets the compiled step's settings: add --compile")
    try:
        args.compile_options = inductor_options(args.inductor, args.compile_mode)  # refused before any model
    except ValueError as err:
        ap.error(str(err))
    dtype = getattr(torch, args.dtype)
    positions = max(4096, args.context + 64)
    teacher = tiny_teacher(layers=args.layers, dtype=dtype, shape=args.shape, positions=positions)
    if args.device == "cuda":
        deeper = (tiny_teacher(layers=args.layers + 1, dtype=dtype, shape=args.shape, positions=positions)
                  if args.compile else None)
        res = cuda_rows(teacher, args, deeper)
    else:
        res = {}
        for name, batch in ((n, b) for b in args.batch for n in ("teacher", "hybrid")):
            s = summarize(count_step(build(teacher, name), batch, args.context))
            res[f"{name} batch {batch}"] = s
            print(f"== {name}, batch {batch}: {s['per_layer']:g} kernel ops per layer per decode step "
                  f"(+{s['per_layer_views']:g} view ops), {s['outside']} outside the layers")
            print("   per layer: " + ", ".join(f"{op} {c:g}" for op, c in s["per_layer_ops"].items()))
            print("   outside:   " + ", ".join(f"{op} {c:g}" for op, c in s["outside_ops"].items()))
    if args.breaks:
        for name in models(args):
            model = build(teacher, name).to(args.device)
            b = graph_breaks(model, args.batch[0], args.context)
            res[f"{name} graph breaks"] = {"graphs": b["graphs"], "breaks": b["breaks"],
                                           "reasons": [[r, loc, n] for (r, loc), n in b["reasons"].items()],
                                           "custom_ops": b["custom_ops"]}
            print(f"== {name}: torch.compile of the step: {b['graphs']} graphs, {b['breaks']} breaks; custom ops "
                  + (", ".join(f"{op} x{n}" for op, n in b["custom_ops"].items()) or "none"))
            for (reason, loc), n in b["reasons"].items():
                print(f"   {n} x {loc}: {reason}")
    if args.json:
        write_text(args.json, json.dumps(res, indent=1))  # atomic (headscope.io)
    return res


def marginal(total: float, total_deeper: float, layers: int) -> dict:
    """Kernels of one more layer (``total_deeper``: the same model one layer deeper) and what is left outside the
    layers (embedding, final norm, head, the step's once-per-step work): ``per_layer`` of a shallow model divides
    the outside kernels among its few layers, which a 28-layer model spreads 14 times thinner."""
    per = total_deeper - total
    return {"per_layer_marginal": per, "outside": total - layers * per}


def time_line(r: dict, top: int = 8) -> str:
    """Where a step's time goes (``count_cuda_kernels(..., timed_steps=N)``): its time, the kernels' share and the
    idle rest, and the kernels taking the most time per step."""
    step, busy = r["step_us"], r["busy_us"]
    idle = max(step - busy, 0.0)
    names = ", ".join(f"{k[:48]} {t:.1f}" for k, t in list(r["time_by_name_us"].items())[:top])
    return (f"time: {step:.1f} us a step at context {r['context']}, kernels {busy:.1f} us ({busy / step:.0%}), "
            f"no kernel running {idle:.1f} us; most time (us a step): {names}")


def cuda_rows(teacher, args, deeper=None, counter=None) -> dict:
    """Kernels per layer per step on the GPU: eager (scoped per layer), replayed, compiled, compiled + replayed.
    ``deeper``: the same teacher one layer deeper; with it the compiled rows (which have no per-layer scopes) also
    get ``per_layer_marginal`` and ``outside`` (``marginal``). ``counter``: ``count_cuda_kernels`` (tests pass a
    stand-in)."""
    counter = counter or count_cuda_kernels
    res = {}
    variants = [("eager", False, False), ("eager, graph", False, True)]
    if args.compile:
        variants += [("compiled", True, False), ("compiled, graph", True, True)]
    for name, batch in ((n, b) for b in args.batch for n in models(args)):
        model = build(teacher, name).cuda()
        deep = build(deeper, name).cuda() if deeper is not None and args.compile else None
        if getattr(args, "gemv", False):
            from hybrid.layers.common import use_decode_gemv

            for m in (model, deep):
                if m is not None:
                    use_decode_gemv(m)
        for label, comp, graph in variants:
            timed = {"timed_steps": args.times} if getattr(args, "times", 0) else {}
            options = getattr(args, "compile_options", None)
            opts = {"compile_options": options} if comp and options else {}
            if getattr(args, "pdl", False):
                opts["pdl"] = True
            r = counter(model, batch, args.context, compile=comp, cuda_graph=graph, compile_mode=args.compile_mode,
                        **timed, **opts)
            if comp and deep is not None:
                r.update(marginal(r["total"], counter(deep, batch, args.context, compile=comp, cuda_graph=graph,
                                                      compile_mode=args.compile_mode, **opts)["total"], r["layers"]))
            if opts.get("compile_options"):
                r["compile_options"] = options
            if opts.get("pdl"):
                r["pdl"] = True
            if getattr(args, "gemv", False):
                r["gemv"] = True
            res[f"{name} batch {batch} {label}"] = r
            line = (f"== {name}, batch {batch}, {label}: {r['total']:g} kernels per step "
                    f"({r['per_layer']:g} per layer over {r['layers']} layers, outside included; "
                    f"+{r['memops']:g} memcpy/memset)")
            if "scoped_per_layer" in r:
                line += f"; inside the layers {r['scoped_per_layer']:g} per layer"
            if "per_layer_marginal" in r:
                line += (f"; one more layer adds {r['per_layer_marginal']:g}, {r['outside']:g} outside the layers")
            print(line, flush=True)
            if "step_us" in r:
                print("   " + time_line(r), flush=True)
            if "scoped" in r and "layer 0" in r["scoped"]:
                print("   layer 0: " + ", ".join(f"{k[:60]} {c:g}" for k, c in
                                               sorted(r["scoped"]["layer 0"].items(), key=lambda kv: -kv[1])))
            elif comp and not graph:  # the compiled step's kernels (inductor's fused ones by name), whole step
                print("   whole step: " + ", ".join(f"{k[:60]} {c:g}" for k, c in r["by_name"].items()))
    return res


if __name__ == "__main__":
    main()
