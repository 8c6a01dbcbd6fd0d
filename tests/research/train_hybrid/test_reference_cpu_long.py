"""research/train_hybrid/reference_cpu_long.toml, reference_cpu_long_rope.toml, reference_cpu_long_rope_log.toml:
the CPU recipe past the reference teacher's 2048 positions, and its two RoPE variants that differ from it in the FA
branch alone; reference_cpu_long_distill750.toml and reference_cpu_long_rope_distill750.toml, the NoPE and RoPE
recipes with stage 2 three times as long; reference_cpu_long_teacher_inputs.toml and
reference_cpu_long_rope_teacher_inputs.toml, stage 1 fed the teacher's layer inputs;
reference_cpu_long_teacher_inputs_distill750.toml, both."""
from __future__ import annotations

from recipe_diff import load, recipe_diff

from hybrid import HybridOptions


def test_stage_3_reads_past_the_teacher_at_a_constant_rate_and_stages_1_2_are_align_qkvs():
    diff = recipe_diff("reference_cpu_align_qkv.toml", "reference_cpu_long.toml")
    assert diff[2] == {"seq_len": (2048, 4096), "lr": (2e-4, 5e-5), "schedule": (None, "constant"),
                       "decay_steps": (30, None), "max_minutes": (5.0, 10.0)}
    # the file names the FA branch that reference_cpu_align_qkv.toml gets by default: the same hybrid
    assert set(diff) == {"top", 2} and set(diff["top"]) == {"hybrid"}
    assert HybridOptions(**load("reference_cpu_long.toml").hybrid) == HybridOptions(
        **load("reference_cpu_align_qkv.toml").hybrid)
    long = load("reference_cpu_long.toml").stages[2]
    assert (long.name, long.seq_len, long.schedule, long.decay_steps) == ("long", 4096, "constant", None)
    assert long.seq_len == 2 * 2048 and long.lr == 5e-5
    assert {long.lr_at(s) for s in range(long.warmup_steps, long.steps)} == {5e-5}
    h = HybridOptions(**load("reference_cpu_long.toml").hybrid)
    assert (h.fa_rope, h.fa_log_scale, h.fa_gate) == (False, True, "sigmoid2")  # the method's FA branch


def _hybrid_diff(variant: str) -> dict:
    diff = recipe_diff("reference_cpu_long.toml", variant)
    assert set(diff) == {"top"} and set(diff["top"]) == {"hybrid"}
    base, other = diff["top"]["hybrid"]
    return {k: (base[k], other[k]) for k in base if base[k] != other[k]}


def test_the_rope_variants_differ_in_the_fa_branch_only():
    assert _hybrid_diff("reference_cpu_long_rope.toml") == {"fa_rope": (False, True), "fa_log_scale": (True, False)}
    assert _hybrid_diff("reference_cpu_long_rope_log.toml") == {"fa_rope": (False, True)}


def test_the_fa_qk_variant_differs_in_stage_1_alone():
    assert recipe_diff("reference_cpu_long.toml", "reference_cpu_long_fa_qk.toml") == {
        0: {"train_fa_qk": (None, True)}}


def test_the_distill750_variants_triple_stage_2_alone():
    for base in ("reference_cpu_long.toml", "reference_cpu_long_rope.toml"):
        variant = base.replace(".toml", "_distill750.toml")
        diff = recipe_diff(base, variant)
        assert diff[1] == {"steps": (250, 750), "max_minutes": (20.0, 45.0)}
        assert set(diff) == {1}  # nothing else (the output folders aside, which load() sets)
        assert load(variant).stages[1].name == "distill"
    # the pair differs in the FA branch as the 250-step pair does
    assert recipe_diff("reference_cpu_long_distill750.toml", "reference_cpu_long_rope_distill750.toml")["top"][
        "hybrid"] == recipe_diff("reference_cpu_long.toml", "reference_cpu_long_rope.toml")["top"]["hybrid"]


def test_the_teacher_inputs_variant_differs_in_stage_1_alone():
    for base in ("reference_cpu_long.toml", "reference_cpu_long_rope.toml"):
        variant = base.replace(".toml", "_teacher_inputs.toml")
        assert recipe_diff(base, variant) == {0: {"align_inputs": (None, "teacher")}}


def test_both_levers_together_differ_from_each_lever_in_the_other_alone():
    both = "reference_cpu_long_teacher_inputs_distill750.toml"
    assert recipe_diff("reference_cpu_long_distill750.toml", both) == {0: {"align_inputs": (None, "teacher")}}
    assert recipe_diff("reference_cpu_long_teacher_inputs.toml", both) == {
        1: {"steps": (250, 750), "max_minutes": (20.0, 45.0)}}
