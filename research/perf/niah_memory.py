"""Peak GPU memory of one NIAH-sized prefill forward (6,139 tokens, use_cache, logits_to_keep=1, float32) of
SmolLM2-135M-Instruct and of an untrained hybrid with the broad recipe's mask: the whole forward at 16 and 32 rows,
and at 4 rows the peak of each layer's attention and MLP (the six largest). Says which model's forward runs out of
memory in the fidelity suite's long NIAH cells, and where. CUDA only; run after `. /tmp/stage/env.sh`:

    python3 -m research.perf.niah_memory
"""
from __future__ import annotations

import time

import torch

T = 6139  # tokens: the fidelity suite's 6,136-token NIAH prompt + its answer room


def peak(model, B: int, hooks: bool = False):
    """(peak GiB above the weights of one no-grad forward of B random rows, or "OOM"; with ``hooks``, the six
    largest per-layer attention / MLP peaks, each reset at the module's start)."""
    ids = torch.randint(100, 20000, (B, T), device="cuda")  # [B, T]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    from headscope.hooks import hooks as attached, post, pre

    rec: list[tuple[int, str]] = []
    before: dict[str, int] = {}

    def start(name):
        def fn(mod, args):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before[name] = torch.cuda.memory_allocated()
        return fn

    def end(name):
        def fn(mod, args, out):
            torch.cuda.synchronize()
            rec.append((torch.cuda.max_memory_allocated() - before[name], name))
        return fn

    layers = [(n, m) for n, m in model.named_modules() if hooks and n.count(".") == 3 and ".layers." in n]
    try:  # model.layers.i.self_attn / mlp / norms, each with its own peak
        with attached([pre(m, start(n)) for n, m in layers], [post(m, end(n)) for n, m in layers]):
            with torch.no_grad():
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        r = (torch.cuda.max_memory_allocated() - base) / 2**30
    except torch.OutOfMemoryError:
        r = "OOM"
    rec.sort(reverse=True)
    return r, [(round(b / 2**30, 2), n) for b, n in rec[:6]]


def main() -> None:
    import hybrid
    from headscope.reference import load_model

    t0 = time.time()
    teacher, _ = load_model("smollm2-135m", device="cuda")
    hyb = hybrid.from_mask(teacher, "research/train_hybrid/smollm2_broad_mask.json", gdn_fold_heads=True,
                           fa_rope=True).to("cuda", torch.float32).eval()
    print("loaded", round(time.time() - t0, 1), "s", next(teacher.parameters()).dtype, flush=True)
    for name, m in (("teacher", teacher), ("hybrid", hyb)):
        print(name, "B=4 per-module peaks GiB:", peak(m, 4, hooks=True), flush=True)
    for B in (16, 32):
        print("hybrid B", B, peak(hyb, B)[0], "teacher B", B, peak(teacher, B)[0], flush=True)
    print("done", round(time.time() - t0, 1), flush=True)


if __name__ == "__main__":
    main()
