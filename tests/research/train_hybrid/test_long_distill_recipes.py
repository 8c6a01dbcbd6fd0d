"""research/train_hybrid/reference_cpu_long_rope_part_kl.toml and smollm2_long_rope_part_kl.toml: their bases with
every stage-3 stage "long_distill" (the KL to the teacher within its positions + 0.2 CE, the distill stage's
weights) in place of "long", nothing else; and the GPU recipe's job, the base job's arguments on the new file."""
from __future__ import annotations

import pytest
from recipe_diff import load, recipe_diff


@pytest.mark.parametrize("base,stage3", [("reference_cpu_long_rope_part.toml", (2,)),
                                         ("smollm2_long_rope_part.toml", (2, 3))])
def test_the_kl_variant_differs_in_its_stage_3_loss_alone(base, stage3):
    variant = base.replace(".toml", "_kl.toml")
    diff = recipe_diff(base, variant)
    assert set(diff) == set(stage3)  # the output folders aside, which load() sets
    for i in stage3:
        assert diff[i] == {"name": ("long", "long_distill")}  # kl_weight 1.0 and ce_weight 0.2 are the defaults
        s, distill = load(variant).stages[i], load(variant).stages[1]
        assert (s.kl_weight, s.ce_weight, s.kl_positions) == (distill.kl_weight, distill.ce_weight, 0) == (1.0, 0.2, 0)


def test_the_kl_job_runs_the_base_jobs_arguments_on_the_kl_recipe():
    from research.launch.jobs import get_job

    base, kl = get_job("smollm2_long_rope_part_hybrid"), get_job("smollm2_long_rope_part_kl_hybrid")
    assert kl.config == ("research/train_hybrid/smollm2_long_rope_part_kl.toml",)
    # the same arguments but the suites' order (within 8K first, the run's question) and no generate() timing (the
    # architecture's, measured by the base run; ~45 s of a lease with no room for it)
    i = base.args.index("--suite") + 1
    assert base.args[i] == "fidelity_long,fidelity" and kl.args[i] == "fidelity,fidelity_long"
    g = base.args.index("--generate-speed")
    rest = [a for k, a in enumerate(base.args) if k not in (i, g, g + 1)]
    assert "--generate-speed" not in kl.args
    assert (kl.kind, [a for k, a in enumerate(kl.args) if k != i], kl.device) == (base.kind, rest, base.device)


@pytest.mark.parametrize("base", ["reference_cpu_long_rope_part.toml", "reference_cpu_long_rope_part_kl.toml"])
def test_the_long90_twins_run_stage_3_three_times_as_long_and_nothing_else(base):
    variant = base.replace(".toml", "_long90.toml")
    s3 = load(base).stages[2]
    assert recipe_diff(base, variant) == {2: {"steps": (30, 90), "max_minutes": (s3.max_minutes, 30.0)}}


def test_the_long90_pair_differs_in_stage_3s_loss_alone():
    diff = recipe_diff("reference_cpu_long_rope_part_long90.toml", "reference_cpu_long_rope_part_kl_long90.toml")
    assert diff == {2: {"name": ("long", "long_distill")}}


def test_the_seed_1_job_runs_the_base_jobs_arguments_with_seed_1():
    from research.launch.jobs import get_job

    base, s1 = get_job("smollm2_long_rope_part_hybrid"), get_job("smollm2_long_rope_part_hybrid_seed1")
    g = base.args.index("--generate-speed")
    assert (s1.kind, s1.config, s1.device) == (base.kind, base.config, base.device)
    assert tuple(s1.args) == tuple(base.args[:g]) + tuple(base.args[g + 2:]) + ("--seed", "1")


def test_the_kl2k_variant_keeps_the_kl_on_the_first_2048_positions_alone():
    diff = recipe_diff("smollm2_long_rope_part_kl.toml", "smollm2_long_rope_part_kl2k.toml")
    assert diff == {2: {"kl_positions": (None, 2048)}, 3: {"kl_positions": (None, 2048)}}  # None: the default, 8192
    assert [s.kl_positions for s in load("smollm2_long_rope_part_kl2k.toml").stages[2:]] == [2048, 2048]
    from research.launch.jobs import get_job

    kl, kl2k = get_job("smollm2_long_rope_part_kl_hybrid"), get_job("smollm2_long_rope_part_kl2k_hybrid")
    assert kl2k.config == ("research/train_hybrid/smollm2_long_rope_part_kl2k.toml",)
    assert (kl2k.kind, tuple(kl2k.args), kl2k.device) == (kl.kind, tuple(kl.args), kl.device)
