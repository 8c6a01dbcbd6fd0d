"""hybrid.decoding: the preallocated per-row cache. Ragged batched decoding equals per-sequence decoding and the
full forward (float64, CPU), for the head-level hybrid, the teacher and the token-level baseline; greedy
decoding equals generate(); the CUDA-graph switch is off on the CPU; errors."""
import pytest
import torch

from headscope.mask import HeadMask
from hybrid.cache import cache_nbytes
from hybrid.convert import from_mask
from hybrid.decoding import Decoder, StaticHybridCache, greedy_decode, prefill, sample_decode, sample_next
from hybrid.builders import from_teacher, from_token_level

from model_factories import tiny_model
from testing_utils import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")
FA = [(0, 1), (0, 2), (1, 0), (1, 3), (2, 2)]  # layer 0: irregular GQA (heads 1, 2 on KV heads 0, 1)


def perturbed(model):
    with torch.no_grad():
        for p in model.new_parameters().values():  # off init, so gates, convs and decays matter
            p.add_(torch.randn_like(p) * 0.1)
    return model


BUILDERS = {
    "head": lambda t: from_mask(t, HeadMask.for_model(t, FA)),
    "head_conv_gated": lambda t: from_mask(t, HeadMask.for_model(t, FA), gdn_conv=True, merge="gated_head"),
    "head_gated_branch": lambda t: from_mask(t, HeadMask.for_model(t, FA), merge="gated_branch", decay="simple"),
    "head_partial_rope": lambda t: from_mask(t, HeadMask.for_model(t, FA), fa_rope=True, fa_rope_max_wavelength=20.0),
    "teacher": lambda t: from_teacher(t),
    "token": lambda t: from_token_level(t, window=4),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_ragged_batched_decoding_equals_full_forward_per_sequence(name):
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = perturbed(BUILDERS[name](teacher))
    torch.manual_seed(1)
    seqs = [torch.randint(0, 128, (n,)) for n in (9, 5, 12)]
    N = 4  # the last N positions of each sequence are decoded one step at a time, all rows together
    cache, logits = prefill(model, [s[:-N] for s in seqs], N)
    dec = Decoder(model, cache)
    assert not dec.use_graph  # CPU: the graph switch is off
    steps = [logits]  # [B, V] per step
    for i in range(N - 1):
        ids = torch.stack([s[len(s) - N + i] for s in seqs])[:, None]  # [B, 1]
        steps.append(dec.step(ids))
    assert cache.host_lengths == [len(s) - 1 for s in seqs] == cache.lengths.tolist()
    for b, s in enumerate(seqs):
        full = model(s[None, :-1], use_cache=False).logits[0, -N:]  # [N, V]
        per_seq = [model(s[None, :len(s) - N]).logits[0, -1]]  # the existing per-sequence decoding
        c = None
        out = model(s[None, :len(s) - N])
        c = out.hybrid_cache
        for i in range(N - 1):
            j = len(s) - N + i
            per_seq.append(model(s[None, j:j + 1], hybrid_cache=c).logits[0, -1])
        got = torch.stack([st[b] for st in steps])  # [N, V]
        assert_close(f"{name} row {b} vs full forward", got, full, "fp64_exact")
        assert_close(f"{name} row {b} vs per-sequence decoding", got, torch.stack(per_seq), "fp64_exact")


def test_batched_multi_token_step_equals_full_forward():
    """A T > 1 step on the preallocated cache (rows at different lengths) equals the full forward."""
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = perturbed(BUILDERS["head_conv_gated"](teacher))
    torch.manual_seed(2)
    seqs = [torch.randint(0, 128, (n,)) for n in (10, 7)]
    cache, _ = prefill(model, [s[:-3] for s in seqs], 3)
    new = torch.stack([s[-3:] for s in seqs])  # [B, 3]
    with torch.no_grad():
        logits = model(new, hybrid_cache=cache).logits  # [B, 3, V]
        for b, s in enumerate(seqs):
            assert_close(f"row {b}", logits[b], model(s[None], use_cache=False).logits[0, -3:], "fp64_exact")


def test_greedy_decode_equals_generate_per_prompt():
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = perturbed(BUILDERS["head"](teacher))
    torch.manual_seed(3)
    prompts = [torch.randint(0, 128, (n,)) for n in (6, 3)]
    tokens = greedy_decode(model, prompts, max_new_tokens=5)  # [B, 5]
    for b, p in enumerate(prompts):
        ref = model.generate(p[None], max_new_tokens=5, do_sample=False, min_new_tokens=5)[0, p.numel():]
        assert tokens[b].tolist() == ref.tolist()


def test_static_cache_bytes_and_errors():
    teacher = tiny_model("qwen3")
    model = BUILDERS["head"](teacher)
    cache = StaticHybridCache.allocate(model, batch=2, capacity=20)
    assert cache.nbytes() == {k: v for k, v in cache_nbytes(model, 20, batch=2, dtype=torch.float32).items()
                              if k != "teacher"}
    with pytest.raises(ValueError, match="cuda_graph=True needs"):
        Decoder(model, cache, cuda_graph=True)
    assert Decoder(model, cache, cuda_graph=False).use_graph is False
    dec = Decoder(model, cache)
    with pytest.raises(ValueError, match=r"ids must be \[B, 1\]"):
        dec.step(torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="capacity"):
        prefill(model, [torch.zeros(30, dtype=torch.long)], 1, capacity=20)
    full, _ = prefill(model, [torch.zeros(4, dtype=torch.long)], 1)
    dec = Decoder(model, full)
    dec.step(torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="capacity is 5"):
        dec.step(torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="non-empty 1-d"):
        prefill(model, [torch.zeros(1, 4, dtype=torch.long)], 1)
    with pytest.raises(NotImplementedError, match="beam"):
        cache.reorder_cache(torch.tensor([1, 0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_bf16_ragged_decoding_matches_full_forward(graph):
    """On the GPU in bf16 (fla's fused recurrent kernel, the Triton prologue where they import), eager and
    CUDA-graph decoding of ragged rows match the full forward within bf16_model."""
    teacher = tiny_model("qwen3", head_dim=64).to("cuda", torch.bfloat16)
    model = perturbed(BUILDERS["head"](teacher))
    torch.manual_seed(4)
    seqs = [torch.randint(0, 128, (n,), device="cuda") for n in (40, 23, 70)]
    N = 6
    cache, logits = prefill(model, [s[:-N] for s in seqs], N)
    dec = Decoder(model, cache, cuda_graph=graph)
    assert dec.use_graph is graph
    steps = [logits.clone()]
    for i in range(N - 1):
        ids = torch.stack([s[len(s) - N + i] for s in seqs])[:, None]  # [B, 1]
        steps.append(dec.step(ids).clone())
    assert cache.host_lengths == [len(s) - 1 for s in seqs] == cache.lengths.tolist()
    with torch.no_grad():
        for b, s in enumerate(seqs):
            full = model(s[None, :-1], use_cache=False).logits[0, -N:].float()  # [N, V]
            got = torch.stack([st[b] for st in steps]).float()
            err = assert_close(f"graph={graph} row {b}", got, full, "bf16_model")
            print(f"decode graph={graph} row {b}: rel err {err:.2e}")


INTERPRETED = """
import torch
import hybrid.ops.decode_attention as da
da.resolve_backend = lambda backend, q: "triton"  # the split-KV kernel on CPU tensors (interpreter)
from model_factories import tiny_model
from testing_utils import assert_close
from headscope.mask import HeadMask
from hybrid.convert import from_mask
from hybrid.decoding import prefill, Decoder
teacher = tiny_model("qwen3")
model = from_mask(teacher, HeadMask.for_model(teacher, [(0, 0), (0, 1), (1, 2), (2, 0)]), prologue_backend="triton")
with torch.no_grad():
    for p in model.new_parameters().values():
        p.add_(torch.randn_like(p) * 0.1)
seqs = [torch.randint(0, 128, (n,)) for n in (9, 5)]
cache, logits = prefill(model, [s[:-3] for s in seqs], 3)
dec = Decoder(model, cache)
steps = [logits] + [dec.step(torch.stack([s[len(s) - 3 + i] for s in seqs])[:, None]) for i in range(2)]
for b, s in enumerate(seqs):
    assert_close(f"row {b}", torch.stack([st[b] for st in steps]), model(s[None, :-1]).logits[0, -3:], "fp32")
print("OK")
"""


def test_decoding_with_both_triton_kernels_in_cpu_interpreter():
    """The GPU decode path (Triton prologue + split-KV attention) end to end, in Triton's CPU interpreter."""
    import os
    import subprocess
    import sys

    from hybrid.ops.prologue import triton_available

    if not triton_available():
        pytest.skip("Triton not importable (the GPU image has it)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "tests"), os.path.join(root, "tests", "hybrid"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("name", ["head", "teacher"])
def test_grouped_prefill_equals_one_prompt_at_a_time(name):
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = perturbed(BUILDERS[name](teacher))
    torch.manual_seed(2)
    prompts = [torch.randint(0, 128, (n,)) for n in (7, 4, 7, 9, 4, 7)]  # three of length 7, two of 4
    c1, l1 = prefill(model, prompts, 3)
    c2, l2 = prefill(model, prompts, 3, group=2)  # groups of <= 2 equal-length prompts
    assert_close("logits", l2, l1, 1e-10)
    assert c2.host_lengths == c1.host_lengths == [len(p) for p in prompts]
    for a, b in zip(c1.layers, c2.layers):
        for x, y in ((a.keys, b.keys), (a.state, b.state)):
            if x is not None:
                assert_close("cache", y, x, 1e-10)
    with pytest.raises(ValueError, match="group=0"):
        prefill(model, prompts, 3, group=0)


def test_sample_next_filters():
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0], [1.0, 0.0, 0.0, 0.0]])  # [B=2, V=4]
    assert sample_next(logits, temperature=0).tolist() == [[1], [0]]
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_next(logits, top_k=2, generator=g) for _ in range(200)], 1)  # [2, 200]
    assert set(draws[0].tolist()) == {1, 2} and set(draws[1].tolist()) <= {0, 1, 2, 3}
    tiny_p = torch.cat([sample_next(logits, top_p=1e-6, generator=g) for _ in range(50)], 1)  # only the argmax
    assert set(tiny_p[0].tolist()) == {1} and set(tiny_p[1].tolist()) == {0}
    nucleus = torch.cat([sample_next(logits, top_p=0.6, generator=g) for _ in range(200)], 1)
    assert set(nucleus[0].tolist()) == {1, 2}  # p(1) ~ 0.52 < 0.6: the nucleus takes token 2 as well, never 0/3
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(ValueError, match="sample_next"):
            sample_next(logits, **bad)


def test_sample_decode_greedy_limit_seeds_and_stops():
    teacher = tiny_model("qwen3", dtype=torch.float64)
    model = perturbed(BUILDERS["head"](teacher))
    torch.manual_seed(3)
    prompts = [torch.randint(0, 128, (n,)) for n in (6, 3, 6)]
    greedy = greedy_decode(model, prompts, 5)  # [B, 5]
    toks, counts = sample_decode(model, prompts, 5, temperature=0, prefill_group=4)
    assert torch.equal(toks, greedy) and counts.tolist() == [5, 5, 5]
    toks, _ = sample_decode(model, prompts, 5, top_p=1e-6)  # a nucleus of one token is greedy too
    assert torch.equal(toks, greedy)
    a = sample_decode(model, prompts, 6, generator=torch.Generator().manual_seed(7))[0]
    b = sample_decode(model, prompts, 6, generator=torch.Generator().manual_seed(7))[0]
    assert torch.equal(a, b)  # seeded: the same samples
    stop = int(greedy[0, 1])  # row 0 meets it at its 2nd token
    toks, counts = sample_decode(model, prompts, 5, temperature=0, stop_ids=[stop], check_every=1)
    first = [next((j + 1 for j, t in enumerate(r) if t == stop), 5) for r in greedy.tolist()]
    assert counts.tolist() == first and counts[0] == 2
    assert torch.equal(toks[:, :2], greedy[:, :2])


# ---- Decoder(compile=True): torch.compile of the step --------------------------------------------------------
def _compiled_vs_eager(model, backend, steps=5, **kw):
    """Logits [steps, B, V] of ragged rows stepped eagerly and compiled, and the compiled Decoder."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(2)
    prompts = [torch.randint(0, 128, (n,)) for n in (7, 4)]
    outs, decs = [], []
    for compile in (False, True):
        cache, logits = prefill(model, prompts, steps + 3)  # room for 3 more steps
        dec = Decoder(model, cache, compile=compile, compile_backend=backend, **kw)
        ids = logits.argmax(-1, keepdim=True)  # [B, 1]
        got = []
        for _ in range(steps):
            got.append(dec.step(ids).clone())  # [B, V]
            ids = got[-1].argmax(-1, keepdim=True)
        outs.append(torch.stack(got))  # [steps, B, V]
        decs.append(dec)
        assert cache.host_lengths == [7 + steps, 4 + steps] == cache.lengths.tolist()
        assert cache.seen_tokens == 7 + steps
    return outs, decs[1]


@pytest.mark.parametrize("name", ["head", "head_partial_rope", "teacher"])
def test_compiled_step_equals_the_eager_step_and_does_not_recompile(name):
    """aot_eager: dynamo's tracing, graph breaks and functionalization of the in-place cache writes, without
    inductor's code generation; steps after the first reuse the compiled graphs."""
    import torch._dynamo

    model = perturbed(BUILDERS[name](tiny_model("qwen3", dtype=torch.float64))).eval()
    (eager, compiled), dec = _compiled_vs_eager(model, "aot_eager", steps=2)
    assert dec.compiled is not None and dec.cache.full_width
    assert_close("compiled vs eager", compiled, eager, "fp64_exact")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ids = torch.tensor([[3], [5]])
    for _ in range(3):
        dec.step(ids)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompilation per step
    torch._dynamo.reset()


def test_compiled_step_with_inductor_equals_the_eager_step_on_the_cpu():
    """Inductor's C++ code on the CPU (float32, the 7:1-style hybrid with both branches)."""
    import torch._dynamo

    model = perturbed(BUILDERS["head"](tiny_model("qwen3", dtype=torch.float32))).eval()
    (eager, compiled), _ = _compiled_vs_eager(model, "inductor", steps=3)
    assert_close("inductor vs eager", compiled, eager, "fp32")
    torch._dynamo.reset()


def test_compile_kwargs_merge_the_modes_settings_under_the_options_and_refuse_unknown_ones():
    from hybrid.decoding import compile_kwargs

    assert compile_kwargs() == {"mode": "default"}
    assert compile_kwargs(mode="max-autotune-no-cudagraphs") == {"mode": "max-autotune-no-cudagraphs"}
    assert compile_kwargs("aot_eager") == {}
    assert compile_kwargs(options={"combo_kernels": True}) == {"options": {"combo_kernels": True}}
    merged = compile_kwargs(mode="max-autotune-no-cudagraphs", options={"combo_kernels": True,
                                                                       "coordinate_descent_tuning": False})
    assert merged == {"options": {"max_autotune": True, "coordinate_descent_tuning": False, "combo_kernels": True}}
    with pytest.raises(ValueError, match=r"\['combo_kernel'\] are not torch._inductor.config settings"):
        compile_kwargs(options={"combo_kernel": True})
    with pytest.raises(ValueError, match="aot_eager"):
        compile_kwargs("aot_eager", options={"combo_kernels": True})
    with pytest.raises(ValueError, match="compile_mode='fastest'"):
        compile_kwargs(mode="fastest", options={"combo_kernels": True})


def test_the_decoder_hands_its_compile_options_to_torch_compile(monkeypatch):
    model = BUILDERS["head"](tiny_model("qwen3", dtype=torch.float32)).eval()
    cache, _ = prefill(model, [torch.zeros(4, dtype=torch.long)], 2)
    seen = {}

    def fake_compile(fn, **kw):
        seen.update(kw)
        return fn
    monkeypatch.setattr(torch, "compile", fake_compile)
    Decoder(model, cache, compile=True, compile_options={"combo_kernels": True})
    assert seen["options"] == {"combo_kernels": True} and "mode" not in seen and seen["dynamic"] is False
    seen.clear()
    Decoder(model, cache, compile=True)
    assert seen["mode"] == "default" and "options" not in seen
    with pytest.raises(ValueError, match="not torch._inductor.config settings"):
        Decoder(model, cache, compile=True, compile_options={"no_such_setting": 1})


def test_pdl_is_off_on_the_cpu_and_on_a_hopper_gpu_adds_inductors_setting_and_wraps_every_step(monkeypatch):
    import hybrid.decoding as decoding
    from hybrid.ops import utils

    model = BUILDERS["head"](tiny_model("qwen3", dtype=torch.float32)).eval()
    prompts = [torch.randint(0, 128, (5,)), torch.randint(0, 128, (3,))]
    cache, logits = prefill(model, prompts, 3)
    plain_cache, _ = prefill(model, prompts, 3)
    ids = logits.argmax(-1, keepdim=True)  # [B, 1]
    dec = Decoder(model, cache, pdl=True)
    assert dec.pdl is False  # the CPU: nothing changes
    assert torch.equal(dec.step(ids), Decoder(model, plain_cache).step(ids))
    seen, flags = {}, []

    def fake_compile(fn, **kw):
        seen.update(kw)
        return fn
    monkeypatch.setattr(decoding, "pdl_supported", lambda t: True)  # as on a GPU of compute capability 9.0+
    monkeypatch.setattr(decoding, "inductor_pdl_options", lambda: {"triton.enable_pdl": True})
    monkeypatch.setattr(decoding, "compile_kwargs", lambda backend, mode, options: {"options": options})
    monkeypatch.setattr(torch, "compile", fake_compile)
    dec = Decoder(model, cache, compile=True, pdl=True, compile_options={"combo_kernels": True})
    assert seen["options"] == {"triton.enable_pdl": True, "combo_kernels": True}
    Decoder(model, cache, compile=True, pdl=True, compile_options={"triton.enable_pdl": False})
    assert seen["options"] == {"triton.enable_pdl": False}  # the caller's setting wins
    handle = model.model.layers[0].register_forward_hook(lambda *a: flags.append(utils._PDL))
    try:
        Decoder(model, cache, pdl=True).step(ids)
        Decoder(model, cache).step(ids)
    finally:
        handle.remove()
    assert flags == [True, False] and not utils._PDL


def test_compiled_step_refuses_a_full_cache():
    import torch._dynamo

    model = BUILDERS["teacher"](tiny_model("qwen3", dtype=torch.float32)).eval()
    cache, _ = prefill(model, [torch.zeros(4, dtype=torch.long)], 1)
    dec = Decoder(model, cache, compile=True, compile_backend="aot_eager")
    dec.step(torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="full"):
        dec.step(torch.zeros(1, 1, dtype=torch.long))
    assert cache.host_lengths == [5] and cache.seen_tokens == 5
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,mode,pdl", [("head", "default", False), ("head", "max-autotune-no-cudagraphs", False),
                                           ("head_partial_rope", "default", False), ("head", "default", True)],
                         ids=["head", "head-max-autotune", "head-partial-rope", "head-pdl"])
def test_gpu_compiled_graph_step_matches_the_eager_step(name, mode, pdl):
    """On the GPU in bf16: the compiled step captured as a CUDA graph gives the eager step's logits (bf16_model);
    also with partial RoPE on the FA heads (its masked cos/sin tables inside the graph), and with programmatic
    dependent launch (``pdl``: the decode kernels' and inductor's, on Hopper)."""
    import torch._dynamo

    torch._dynamo.reset()
    teacher = tiny_model("qwen3", head_dim=64).to("cuda", torch.bfloat16)
    model = perturbed(BUILDERS[name](teacher))
    torch.manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), device="cuda") for n in (40, 23, 70)]
    outs = []
    for compile in (False, True):
        cache, logits = prefill(model, prompts, 6)
        dec = Decoder(model, cache, cuda_graph=True, compile=compile, compile_mode=mode, pdl=pdl and compile)
        ids = logits.argmax(-1, keepdim=True)  # [B, 1]
        got = []
        for _ in range(5):
            got.append(dec.step(ids).clone())  # [B, V]
            ids = torch.tensor([[3], [5], [7]], device="cuda")
        outs.append(torch.stack(got).float())  # [5, B, V]
        assert cache.host_lengths == [45, 28, 75] == cache.lengths.tolist()
    err = assert_close(f"{name}: compiled ({mode}, pdl {pdl}) vs eager", outs[1], outs[0], "bf16_model")
    print(f"{name}: compiled {mode} (pdl {pdl}) + graph vs eager graph: rel err {err:.2e}")
    torch._dynamo.reset()


def test_compiled_step_of_many_distinct_layers_stays_compiled():
    """12 layers with 12 different FA head sets: each is a compiled variant of the layers' shared code; the
    Decoder raises dynamo's recompile limit (8 by default), so none falls back to eager (a hard error here)."""
    import torch._dynamo

    from research.count_decode_ops import tiny_teacher

    torch._dynamo.reset()
    cfg = torch._dynamo.config
    teacher = tiny_teacher(layers=12, dtype=torch.float32)
    fa = [(l, h) for l in range(12) for h in range(4) if (l >> h) & 1]  # layer l: the heads of l's bits
    model = from_mask(teacher, HeadMask.for_model(teacher, fa)).eval()
    cache, _ = prefill(model, [torch.randint(0, 128, (5,))], 4)
    # the limits the Decoder raises are restored on leaving
    with cfg.patch(fail_on_recompile_limit_hit=True, recompile_limit=cfg.recompile_limit,
                   accumulated_recompile_limit=cfg.accumulated_recompile_limit):
        dec = Decoder(model, cache, compile=True, compile_backend="aot_eager")
        assert cfg.recompile_limit >= 4 * 12 + 8
        for _ in range(3):
            dec.step(torch.tensor([[3]]))
    assert cache.host_lengths == [8]
    torch._dynamo.reset()
