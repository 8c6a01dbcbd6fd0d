"""The registered evaluations and suites.

    smoke      every evaluation, tiny settings: CPU, < 60 s on the reference model (the tests use it)
    retrieval  single-key NIAH (length x depth), multi-key NIAH, template transfer
    reasoning  each reasoning family by size
    default    everything at full settings (= "full"): lengths from 1/8 to 8x the training length
    fidelity   a student against its teacher (teacher=...) on held-out text, continuations, chat and NIAH;
               fidelity_smoke: the same at tiny settings (the reference model against itself: CPU, < 3 min)
               fidelity_reference: lengths within the reference model's 2048 positions (its hybrid, on the CPU)
    fidelity_long  past the teacher's context: held-out perplexity at 8K-32K and NIAH at 16K-64K, the teacher's
               rows "not_applicable" past its positions (headscope.evaluate.fidelity_long)
               fidelity_long_reference: held-out perplexity at 1K-8K, for the reference model's hybrid (CPU)
"""
from __future__ import annotations

from headscope.evaluate import fidelity, fidelity_long, measures, retrieval
from headscope.evaluate.registry import register_evaluation, register_suite

register_evaluation("niah", retrieval.niah, retrieval.NiahEvalConfig,
                    "single-key needle in a haystack: accuracy by context length x needle depth")
register_evaluation("niah_multikey", retrieval.niah_multikey, retrieval.MultikeyEvalConfig,
                    "multi-key needle in a haystack (2, 4, 8 keys) by context length")
register_evaluation("template_transfer", retrieval.template_transfer, retrieval.TemplateTransferConfig,
                    "single-key NIAH in needle/question phrasings the model was not trained on")
register_evaluation("reasoning", measures.reasoning, measures.ReasoningEvalConfig,
                    "arithmetic, binding, comparison, two-hop: accuracy by family and size")
register_evaluation("perplexity", measures.perplexity, measures.PerplexityEvalConfig,
                    "held-out perplexity by context length, loss by position")
register_evaluation("cost", measures.cost, measures.CostEvalConfig,
                    "prefill time and peak memory by length, decode time per token, cache bytes")

_SMOKE_LEN = (0.125,)  # of the training length (the reference model: 248 tokens)
register_suite("smoke", [
    ("niah", {"multiples": _SMOKE_LEN, "depths": (0.0, 0.5, 1.0), "n": 1}),
    ("niah_multikey", {"multiples": _SMOKE_LEN, "n_keys": (2, 4), "n": 1}),
    ("template_transfer", {"multiples": _SMOKE_LEN, "n": 1}),
    ("reasoning", {"sizes": (), "n": 4}),
    ("perplexity", {"multiples": (0.0625, 0.125), "n_windows": 2, "bins": 8}),
    ("cost", {"multiples": (0.0625, 0.125), "repeats": 1, "decode_context": 64, "decode_tokens": 4}),
])
register_suite("retrieval", ["niah", "niah_multikey", "template_transfer"])
register_suite("reasoning", ["reasoning"])
_ALL = ["niah", "niah_multikey", "template_transfer", "reasoning", "perplexity", "cost"]
register_suite("default", _ALL)
register_suite("full", _ALL)

# fidelity to the teacher (headscope.evaluate.fidelity): evaluate(student, "fidelity", teacher=teacher)
register_evaluation("fidelity_text", fidelity.fidelity_text, fidelity.FidelityTextConfig,
                    "held-out text: student and teacher perplexity, their ratio, KL(teacher || student), top-1 "
                    "agreement", needs_teacher=True)
register_evaluation("fidelity_continuation", fidelity.fidelity_continuation, fidelity.ContinuationConfig,
                    "greedy continuations of held-out prefixes: tokens shared with the teacher's before they part",
                    needs_teacher=True)
register_evaluation("fidelity_chat", fidelity.fidelity_chat, fidelity.ChatConfig,
                    "held-out instructions: the teacher's NLL of the student's greedy answer / of its own",
                    needs_teacher=True)
register_evaluation("fidelity_niah", fidelity.fidelity_niah, fidelity.FidelityNiahConfig,
                    "NIAH in held-out phrasings and haystack sources, student and teacher, by length",
                    needs_teacher=True)
_FIDELITY = ["fidelity_text", "fidelity_continuation", "fidelity_chat", "fidelity_niah"]
register_suite("fidelity", _FIDELITY)
_SMOKE_SOURCES = ("shakespeare", "python_code", "python_docs")  # prose, code, docs: fixed, whatever ships later
register_suite("fidelity_smoke", [  # the reference model against itself: 2 CPU cores, well under 3 minutes
    ("fidelity_text", {"window": 256, "n_windows": 4}),  # every shipped source
    ("fidelity_continuation", {"sources": _SMOKE_SOURCES, "prefix": 64, "new_tokens": 32, "n": 4}),
    ("fidelity_chat", {"n": 8, "max_new_tokens": 16}),
    # 4088 tokens exceed the reference model's 2048 positions: rows "skipped" with a note
    ("fidelity_niah", {"sources": _SMOKE_SOURCES, "lengths": (1024 - 8, 4096 - 8), "n": 1}),
])
register_suite("fidelity_reference", [  # a hybrid of the reference model against it: lengths within its 2048 positions
    ("fidelity_text", {"window": 1024, "n_windows": 4}),  # every shipped source
    ("fidelity_continuation", {"prefix": 128, "new_tokens": 32, "n": 8}),  # every shipped source
    ("fidelity_chat", {"n": 8, "max_new_tokens": 16}),  # the reference tokenizer has no chat template: skipped
    ("fidelity_niah", {"sources": _SMOKE_SOURCES, "lengths": (1024 - 8, 2048 - 8), "n": 2}),
])

# past the teacher's context (headscope.evaluate.fidelity_long): evaluate(student, "fidelity_long", teacher=teacher)
register_evaluation("fidelity_long_text", fidelity_long.fidelity_long_text, fidelity_long.FidelityLongTextConfig,
                    "held-out perplexity at 8K-32K; the teacher's where it has the positions, in chunks past them",
                    needs_teacher=True)
register_evaluation("fidelity_long_niah", fidelity_long.fidelity_long_niah, fidelity_long.FidelityLongNiahConfig,
                    "NIAH in held-out phrasings and haystacks at 16K-64K; the teacher where it has the positions",
                    needs_teacher=True)
register_suite("fidelity_long", ["fidelity_long_text", "fidelity_long_niah"])
# the reference model's hybrid past the reference teacher's 2048 positions (2x, 4x), with 1x and 0.5x to compare:
# held-out perplexity only, since the reference teacher answers NIAH in no held-out phrasing (0.00 within 2048)
register_suite("fidelity_long_reference", [("fidelity_long_text", {"lengths": (1024, 2048, 4096, 8192),
                                                                    "n_windows": 2})])
