"""research.stage_carry: what a job's commands carry (wheels, data/gz, an ignored scores file; the staged parts once
a machine), parts grouped into staging commands, the lease's plan, and sizes counted in whole disk blocks."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from research import stage_carry
from research.launch import KINDS


def test_carry_lists_the_paths_a_job_needs():
    c = stage_carry.carry("smollm2_hybrid")
    assert "data/gz" in c["every_call"]
    assert any("fla_core" in p for p in c["every_call"]) and any("gguf" in p for p in c["every_call"])
    if c["stage_once"]:
        # the GGUF's parts, and a compile cache's where one was brought back into .stage/
        assert any(".stage/smollm2-135m.gguf.part" in p for p in c["stage_once"])
        assert all(".stage/smollm2-135m.gguf.part" in p or ".stage/compile_cache.tgz.part" in p
                   for p in c["stage_once"])
    else:
        assert "python -m research.stage split --model smollm2-135m" in c["missing"].values()
    assert c["limit_bytes"] == 64 * 2**20 and c["per_call_bytes"] >= c["tree_bytes"] > 0
    tiny = stage_carry.carry("tiny_hybrid")
    assert [p for p in tiny["stage_once"] if ".stage/compile_cache.tgz.part" not in p] == []
    assert not any("fla" in p or p == "data/gz" for p in tiny["every_call"])


def test_stage_commands_pack_small_parts_together():
    sizes = {"a.part1of2": 18, "a.part2of2": 4, "b.part1of2": 16, "b.part2of2": 6, "c.part1of1": 7}
    groups = stage_carry.stage_commands(list(sizes), sizes, room=19)
    assert sorted(p for g in groups for p in g) == sorted(sizes)  # every part once
    assert all(sum(sizes[p] for p in g) <= 19 for g in groups) and len(groups) == 3  # 51 units: no fewer fit
    assert groups[0] == ["a.part1of2"]  # in the parts' order
    assert stage_carry.stage_commands(["big"], {"big": 30}, room=19) == [["big"]]  # too large: alone (carry flags it)
    c = stage_carry.carry("smollm2_hybrid")
    assert sorted(p for g in c["stage_commands"] for p in g) == sorted(c["stage_once"])


def test_lease_plan_stages_then_runs_the_job_detached():
    c = {"job": "j", "every_call": [".whl/a.whl", "data/gz"], "stage_commands": [["p1"], ["p2", "p3"]]}
    plan = stage_carry.lease_plan(c, seconds=500)
    assert [call["carry"] for call in plan] == [["p1"], ["p2", "p3"], [".whl/a.whl", "data/gz"], []]
    assert all(call["command"] == stage_carry.STAGE_COMMAND for call in plan[:2])
    job, caches = plan[-2:]
    assert 'teacher-cache save "$OUT/teacher_cache_j.tgz"' in caches["command"] and "when" in caches
    assert 'harvest j "$OUT"' in caches["command"]  # what the job commands' harvests did not send
    assert "research/train_hybrid/detached.sh j 500" in job["command"] and "pack /tmp/runs/j" in job["command"]
    # after each job command, before its exit status: the teacher's text and compile cache made so far
    assert job["command"].index("pack /tmp/runs/j") < job["command"].index('harvest j "$OUT"')
    assert job["command"].endswith("exit $rc") and job["timeout_s"] == 565 and "again" in job
    assert "560 s" in job["last"] and "pack" in job["last"]  # the lease's last call leaves time to pack and harvest
    assert "research.stage stow" in job["here"]
    r = subprocess.run([sys.executable, "-m", "research.stage", "carry", "smollm2_hybrid", "--plan", "--json"],
                       capture_output=True, text=True, cwd=stage_carry.REPO)
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)[-2]
    assert job["carry"] == stage_carry.carry("smollm2_hybrid")["every_call"]
    # by default the job waits 530 s and pack + harvest (~40 s with a large compile cache) fit the call's 600 s
    assert "detached.sh smollm2_hybrid 530" in job["command"] and job["timeout_s"] == 595


def test_sizes_count_whole_disk_blocks(tmp_path):
    # the machine's 64 MiB counts what files take on disk: a part cut to the byte-count room was refused
    (tmp_path / "one_byte").write_bytes(b"x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 4097)
    (tmp_path / "d" / "b").write_bytes(b"")
    assert stage_carry._size(tmp_path / "one_byte") == 4096
    assert stage_carry._size(tmp_path / "d") == 8192
    assert stage_carry._size(tmp_path / "missing") == 0


def test_carry_of_the_broad_recipe_stages_its_corpus():
    c = stage_carry.carry("smollm2_broad_hybrid")
    if any("corpus.tar.xz" in p for p in c["stage_once"]):
        assert all(stage_carry.CORPUS_RE.match(Path(p).name) or ".gguf.part" in p
                   or stage_carry.COMPILE_RE.match(Path(p).name) for p in c["stage_once"])
    else:
        assert "python -m research.stage split-corpus" in c["missing"].values()
    assert "data/gz" in c["every_call"]  # its NIAH haystack "train" is research.prepare_corpus's train.txt


def test_carry_lists_an_ignored_scores_file(tmp_path, monkeypatch):
    import subprocess

    repo = tmp_path / "repo"
    (repo / "runs" / "cache").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/runs/\n")
    (repo / "runs" / "cache" / "scores.json").write_text("{}")
    (repo / "tracked.json").write_text("{}")
    jobs = tmp_path / "jobs.toml"
    jobs.write_text('[jobs.scored]\nkind = "train_hybrid"\nconfig = "research/train_hybrid/tiny.toml"\n'
                    'args = ["--tiny", "--scores", "runs/cache/scores.json"]\ndevice = "cpu"\n'
                    '[jobs.tracked]\nkind = "train_hybrid"\nconfig = "research/train_hybrid/tiny.toml"\n'
                    'args = ["--tiny", "--scores=tracked.json"]\ndevice = "cpu"\n'
                    '[jobs.absent]\nkind = "train_hybrid"\nconfig = "research/train_hybrid/tiny.toml"\n'
                    'args = ["--tiny", "--scores", "runs/cache/none.json"]\ndevice = "cpu"\n')
    monkeypatch.setattr(stage_carry, "REPO", repo)
    c = stage_carry.carry("scored", str(jobs))
    # 2 bytes: one disk block
    assert "runs/cache/scores.json" in c["every_call"] and c["bytes"]["runs/cache/scores.json"] == 4096
    tracked = stage_carry.carry("tracked", str(jobs))["every_call"]
    assert not any("scores" in p or "json" in p for p in tracked)  # travels
    assert not any("none.json" in p for p in stage_carry.carry("absent", str(jobs))["every_call"])  # computed there
    (repo / ".stage").mkdir()
    for k in (2, 1):  # a compile cache brought back: staged once, in order, for any job
        (repo / ".stage" / f"compile_cache.tgz.part{k}of2").write_bytes(b"x")
    assert stage_carry.carry("scored", str(jobs))["stage_once"] == [".stage/compile_cache.tgz.part1of2",
                                                              ".stage/compile_cache.tgz.part2of2"]
    assert stage_carry.carry("bench_decode_best")["stage_once"] == []  # a benchmark compiles other graphs
    assert set(stage_carry.TRAINING_KINDS) <= set(KINDS)


def test_parts_are_cut_to_travel_beside_the_tree(monkeypatch):
    """A part travels in a command of its own beside the working tree: the default size is the room the tree
    leaves (less 1 MiB, at most PART_MB), and `carry` names a part that no longer fits and the size to cut again."""
    limit = stage_carry.CARRY_LIMIT
    assert stage_carry.default_part_mb(35 * 10**6) == stage_carry.PART_MB  # a small tree: the largest parts
    mb = stage_carry.default_part_mb(43 * 10**6)
    assert mb < stage_carry.PART_MB and 43 * 10**6 + mb * 2**20 <= limit - 2**20
    with pytest.raises(stage_carry.StageError, match="leaves no room"):
        stage_carry.default_part_mb(limit)
    c = {"job": "j", "every_call": [], "stage_once": ["a.part1of2", "a.part2of2", "b.part1of1"],
         "bytes": {"a.part1of2": 27 * 10**6, "a.part2of2": 5 * 10**6, "b.part1of1": 20 * 10**6},
         "tree_bytes": 43 * 10**6, "per_call_bytes": 60 * 10**6, "limit_bytes": limit, "missing": {},
         "part_room_bytes": limit - 60 * 10**6}
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        stage_carry.print_carry(c)
    lines = {l.split()[0]: l for l in out.getvalue().splitlines() if l.startswith("  ") and ".part" in l}
    assert "too large even alone" in lines["a.part1of2"] and f"--part-mb {mb}" in lines["a.part1of2"]
    assert "fits beside the carry above" in lines["a.part2of2"]
    assert "in a command of its own" in lines["b.part1of1"]
