"""research/train_hybrid/reference_cpu_align_qkv.toml, reference_cpu_align_long.toml and reference_cpu_align_900.toml:
reference_cpu.toml with stage 1 training the GDN heads' q/k/v too, then that with stage 1 three times as long, then
three times as long again, nothing else changed, so that each one's fidelity against the one before measures one
setting; and reference_cpu_align_long_teacher_inputs.toml, the 3x stage 1 fed the teacher's layer inputs."""
from __future__ import annotations

from recipe_diff import load, recipe_diff


def test_only_stage_one_scope_differs():
    assert [s.train_gdn_qkv for s in load("reference_cpu.toml").stages] == [False, True, True]
    diff = recipe_diff("reference_cpu.toml", "reference_cpu_align_qkv.toml")
    assert diff.pop(0) in ({"train_gdn_qkv": (False, None)}, {"train_gdn_qkv": (False, True)})
    assert diff == {}
    assert [s.train_gdn_qkv for s in load("reference_cpu_align_qkv.toml").stages] == [True, True, True]


def test_align_long_differs_from_align_qkv_by_stage_one_length_alone():
    assert recipe_diff("reference_cpu_align_qkv.toml", "reference_cpu_align_long.toml") == {
        0: {"max_minutes": (10.0, 40.0), "steps": (100, 300)}}


def test_align_900_differs_from_align_long_by_stage_one_length_alone():
    assert recipe_diff("reference_cpu_align_long.toml", "reference_cpu_align_900.toml") == {
        0: {"max_minutes": (40.0, 120.0), "steps": (300, 900)}}


def test_align_long_teacher_inputs_differs_from_align_long_by_what_stage_one_reads_alone():
    assert recipe_diff("reference_cpu_align_long.toml", "reference_cpu_align_long_teacher_inputs.toml") == {
        0: {"align_inputs": (None, "teacher")}}
