"""Study 5 on SmolLM2's long recipe, one job a row: smollm2_long.toml (NoPE + log scale, the method's),
smollm2_long_rope_part.toml (partial RoPE + log scale) and smollm2_long_rope_log.toml (the teacher's RoPE + log scale)
differ in the FA heads' positions alone, and their jobs in nothing but the recipe file; the stage-1 scope row
smollm2_long_rope_part_frozen_qkv.toml differs from the partial-RoPE row in train_gdn_qkv alone."""
from __future__ import annotations

import pytest
from recipe_diff import load, recipe_diff

ROWS = {"smollm2_long.toml": ("smollm2_long_hybrid", {"fa_rope": False}),
        "smollm2_long_rope_part.toml": ("smollm2_long_rope_part_hybrid",
                                        {"fa_rope": True, "fa_rope_max_wavelength": 8192}),
        "smollm2_long_rope_log.toml": ("smollm2_long_rope_log_hybrid", {"fa_rope": True})}


@pytest.mark.parametrize("variant", ["smollm2_long_rope_part.toml", "smollm2_long_rope_log.toml"])
def test_the_rows_differ_in_the_fa_heads_positions_alone(variant):
    diff = recipe_diff("smollm2_long.toml", variant)
    assert set(diff) == {"top"} and set(diff["top"]) == {"hybrid"}  # the stages equal, steps included
    base, row = diff["top"]["hybrid"]
    changed = {k for k in set(base) | set(row) if base.get(k) != row.get(k)}
    assert changed == set(ROWS[variant][1]) and all(row[k] == v for k, v in ROWS[variant][1].items())
    for cfg in (load("smollm2_long.toml"), load(variant)):  # the log scale and the gate in every row
        assert (cfg.hybrid["fa_log_scale"], cfg.hybrid["fa_gate"]) == (True, "sigmoid2")


def test_each_row_is_a_job_of_the_same_arguments():
    from research.launch.jobs import get_job

    jobs = {recipe: get_job(name) for recipe, (name, _) in ROWS.items()}
    for recipe, job in jobs.items():
        assert job.config == (f"research/train_hybrid/{recipe}",)
    first = jobs["smollm2_long.toml"]
    assert all((j.kind, j.args, j.device) == (first.kind, first.args, first.device) for j in jobs.values())


def test_the_stage_1_scope_row_freezes_the_gdn_heads_qkv_and_nothing_else():
    from research.launch.jobs import get_job

    diff = recipe_diff("smollm2_long_rope_part.toml", "smollm2_long_rope_part_frozen_qkv.toml")
    assert diff == {0: {"train_gdn_qkv": (True, False)}}
    base, row = get_job("smollm2_long_rope_part_hybrid"), get_job("smollm2_long_rope_part_frozen_qkv_hybrid")
    assert row.config == ("research/train_hybrid/smollm2_long_rope_part_frozen_qkv.toml",)
    assert (row.kind, row.args, row.device) == (base.kind, base.args, base.device)
