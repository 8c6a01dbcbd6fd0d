"""research/train_hybrid/smollm2_long.toml: the recipe as written (the method's FA branch, stages 1-2 of the broad
recipe, two constant-lr long stages past the teacher's 8192 positions on document windows), then a miniature of it
run through every stage on the CPU: a tiny teacher of 128 positions, every length / 64 (stages 1-2 at 32, the long
stages at 256 and 512: past the teacher's positions, as 16K and 32K are past SmolLM2's 8192), a small corpus manifest
with a held-out source, a few steps per stage."""
from __future__ import annotations

from pathlib import Path

import pytest
from train_factories import write_broad_corpus

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "research" / "train_hybrid" / "smollm2_long.toml"
SCALE = 64  # the miniature's lengths: the recipe's / 64


def recipe(**overrides):
    from hybrid.train import TrainConfig

    return TrainConfig.from_file(RECIPE, mask="mask.json", out="run", **overrides)


def test_the_recipe_as_written():
    from hybrid.config import HybridOptions
    from hybrid.train import TrainConfig

    cfg = recipe()
    opts = HybridOptions.from_dict(cfg.hybrid)
    assert (opts.fa_rope, opts.fa_log_scale, opts.fa_gate, opts.log_scale_base) == (False, True, "sigmoid2", 512.0)
    assert [s.name for s in cfg.stages] == ["align", "distill", "long", "long"]
    align, distill, long16, long32 = cfg.stages
    assert align.train_gdn_qkv  # stage 1: the new parameters and the GDN heads' q/k/v
    # stages 1-2 as the best broad recipe's (a 3x stage 1 on the teacher's inputs), the same fixed steps: that
    # recipe's two seeds are the baseline within the teacher's context
    best = TrainConfig.from_file(ROOT / "research" / "train_hybrid" / "smollm2_broad_align_long_teacher_inputs.toml",
                                 mask="m.json", out="r")
    assert cfg.stages[:2] == best.stages and cfg.data == best.data and cfg.eval == best.eval == "none"
    assert distill.micro_batch_size == 32  # two passes of 32 rows: the same step, which an 80 GB GPU holds
    assert align.align_inputs == "teacher"
    assert (align.steps, align.lr, align.seq_len, align.batch_size, align.max_minutes) == (540, 2e-3, 2048, 16, 6.0)
    assert (distill.steps, distill.lr, distill.seq_len, distill.batch_size, distill.max_minutes) == (
        260, 5e-4, 2048, 64, 6.0)
    assert cfg.data.corpus == "data/corpus/manifest.json" and cfg.data.teacher_corpus == "data/corpus/teacher"
    teacher_positions = 8192  # SmolLM2-135M-Instruct's max_position_embeddings
    # fixed steps: what the first run of these stages trained in its 2-minute budget on an H100, so that every
    # branch and loss of stage 3 trains as many tokens; the minutes only a safety cap
    for s, T, B, n in ((long16, 16384, 2, 415), (long32, 32768, 1, 377)):
        assert (s.seq_len, s.batch_size, s.schedule, s.steps, s.max_minutes) == (T, B, "constant", n, 5.0)
        assert T > teacher_positions
        assert s.decay_steps is None and s.lr == pytest.approx(0.1 * distill.lr)
        assert [s.lr_at(i) for i in (s.warmup_steps, s.steps // 2, s.steps - 1)] == [s.lr] * 3
        d = cfg.data_for(s)
        assert d.text_windows == "documents" and d.teacher_corpus == "" and d.corpus == cfg.data.corpus


def miniature(tmp_path: Path, teacher_dir: Path, mask: Path) -> dict:
    """The recipe's config with every length / SCALE, a few steps per stage, CPU settings and the test corpus."""
    manifest = write_broad_corpus(tmp_path / "corpus")
    d = recipe().to_dict()
    d.update(out=str(tmp_path / "run"), teacher=str(teacher_dir), mask=str(mask), device="cpu", compile=False,
             teacher_dtype="float32", compile_teacher=False, progress=False, log_every=1, checkpoint_every=0,
             eval="default", eval_samples=1, threads=1)

    def small(data: dict) -> dict:
        data = {**data, "corpus": manifest, "workers": 0, "haystack": "heldout"}
        if data.get("teacher_corpus"):
            data["teacher_corpus"] = str(tmp_path / "corpus" / "teacher")
        return data

    d["data"] = small(d["data"])
    for s in d["stages"]:
        s.update(seq_len=s["seq_len"] // SCALE, steps=4, batch_size=min(s["batch_size"], 2), max_minutes=0.0,
                 warmup_steps=min(s["warmup_steps"], 2))
        if s.get("micro_batch_size"):  # the passes in proportion: two of one row
            s["micro_batch_size"] = 1
        if s.get("data"):
            s["data"] = small(s["data"])
    return d


def test_a_miniature_of_the_recipe_runs_every_stage_past_the_teachers_positions(tmp_path, ref_tokenizer):
    from transformers import AutoModelForCausalLM

    import hybrid
    from hybrid.train import TrainConfig, run
    from train_factories import save_mask, save_tiny_teacher

    teacher_dir = save_tiny_teacher(tmp_path / "teacher", ref_tokenizer, max_position_embeddings=128)
    mask = save_mask(teacher_dir, tmp_path / "mask.json")
    cfg = TrainConfig.from_dict(miniature(tmp_path, teacher_dir, mask))
    assert [s.seq_len for s in cfg.stages] == [32, 32, 256, 512]  # the long stages past the teacher's 128 positions
    res = run(cfg)
    steps = [r for r in res.history if "loss" in r]
    assert [(r["stage_index"], r["seq_len"]) for r in steps] == [(i, T) for i, T in enumerate((32, 32, 256, 512))
                                                                for _ in range(4)]
    for i, s in enumerate(cfg.stages):
        lrs = [r["lr"] for r in steps if r["stage_index"] == i]
        if s.schedule == "constant":  # warm-up, then the stage's lr to its end
            assert lrs == [pytest.approx(s.lr / 2), pytest.approx(s.lr), pytest.approx(s.lr), pytest.approx(s.lr)]
        else:
            assert lrs[-1] < lrs[1]  # the cosine of stages 1-2
    assert all(0 < r["loss"] < 50 for r in steps)
    checks = [r for r in res.history if "eval_heldout_loss" in r]
    assert [r["stage_index"] for r in checks] == [0, 1, 2, 3] and all("eval_niah_acc" in r for r in checks)
    hybrid.register()
    saved = AutoModelForCausalLM.from_pretrained(res.model_path)
    opts = saved.config.options
    assert (opts.fa_rope, opts.fa_log_scale, opts.fa_gate) == (False, True, "sigmoid2")
    assert saved.config.max_position_embeddings == 128  # the teacher's, kept as a record; nothing caps at it


def test_the_job_reads_the_broad_recipes_mask_and_runs_the_long_suite_first():
    from research.launch.jobs import get_job

    args = get_job("smollm2_long_hybrid").args
    assert args[args.index("--mask") + 1] == "research/train_hybrid/smollm2_broad_mask.json"
    assert args[args.index("--suite") + 1] == "fidelity_long,fidelity"  # past 8K first: the recipe's question
    assert args[args.index("--max-eval-length") + 1] == "2048"
    # generate() at 32K positions (4x the teacher's) beside the teacher's at its own 8192, new tokens included
    assert args[args.index("--generate-speed") + 1] == "32640,8064"
