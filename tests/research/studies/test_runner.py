"""research.studies.config / studies / study_metrics: the study config (dry-run merge, steps scale, refusals), the evaluation
items' order, the headline metrics and tables from evaluation rows, the docs block."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from research.studies.config import StudyConfig, StudyError, eval_items
from research.studies.variants import VariantSpec
from research.studies.metrics import BEGIN, END, headline, markdown_block, study_table, to_markdown, update_docs

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "research" / "studies" / "reference.toml"
SMOLLM2 = ROOT / "research" / "studies" / "smollm2.toml"

MINIMAL = """
[train]
[[train.stages]]
name = "align"
steps = 10
lr = 1e-3
seq_len = 64
warmup_steps = 4
[[train.stages]]
name = "distill"
steps = 30
lr = 1e-3
seq_len = 64
decay_steps = 20
[[variants]]
name = "a"
fraction = 0.125
"""


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def test_reference_config_loads_and_scales_every_stage_alike():
    cfg = StudyConfig.from_file(CONFIG)
    assert {v.name for v in cfg.variants} >= {"teacher", "global-kv", "layerwise-7to1", "token-swa257", "fa-rope"}
    assert {s for v in cfg.variants for s in v.studies} == {2, 3, 4, 5, 7}
    assert [v.name for v in cfg.variants if 7 in v.studies] == ["teacher", "teacher-tuned", "global-kv", "randglobal-kv",
                                                                "learned-kv"]
    assert cfg.variant("learned-kv").needs_data and cfg.selector["steps"] == 120
    half = StudyConfig.from_file(CONFIG, steps_scale=0.5)
    assert [s["steps"] for s in half.train["stages"]] == [round(s["steps"] / 2) for s in cfg.train["stages"]]
    assert half.steps_scale == 0.5 and not half.dry_run
    dry = StudyConfig.from_file(CONFIG, dry_run=True)
    assert dry.dry_run and dry.device == "cpu" and len(dry.variants) == 7
    assert dry.selector == {**cfg.selector, "steps": 4, "batch_size": 1, "seq_len": 128}  # merged, not replaced
    assert [s["steps"] for s in dry.train["stages"]] == [2, 2, 1]
    assert dry.train["data"]["corpus"] == "heldout" and dry.train["data"]["fast_niah"]  # merged, not replaced


def test_cpu_profile_merges_its_table_adds_its_variants_and_says_what_it_is(tmp_path):
    cpu = StudyConfig.from_file(CONFIG, profile="cpu")
    base = StudyConfig.from_file(CONFIG)
    assert cpu.profile == "cpu" and "CPU-scale" in cpu.profile_note and not cpu.dry_run
    assert cpu.device == "cpu" and cpu.train_length == 128 and base.profile == "" and base.train_length == 0
    assert [s["seq_len"] for s in cpu.train["stages"]] == [128, 128, 512]
    assert cpu.train["data"]["corpus"] == base.train["data"]["corpus"]  # merged, not replaced
    names = [v.name for v in cpu.variants]
    assert "token-swa257" not in names and names[-1] == "token-swa17" and cpu.variant("token-swa17").window == 17
    assert "token-swa17" not in [v.name for v in base.variants]
    assert [i[0] for i in eval_items(cpu, cpu.train_length)][:1] == ["niah@120"]
    cfg = cpu.to_dict()
    cfg["train_length"] = 128
    block = markdown_block({"config": cfg, "calls": [], "runs": []}, command="c")
    assert "**Profile `cpu`**: a CPU-scale replication" in block and "not a result" not in block
    with pytest.raises(StudyError, match=r"no \[profiles.gpu\] table; known: \['cpu'\]"):
        StudyConfig.from_file(CONFIG, profile="gpu")
    with pytest.raises(StudyError, match="give one of them"):
        StudyConfig.from_file(CONFIG, profile="cpu", dry_run=True)
    bad = write(tmp_path, MINIMAL + '[profiles.x]\nvariants = ["zz"]\n')
    with pytest.raises(StudyError, match=r"\[profiles.x\].variants: \['zz'\]"):
        StudyConfig.from_file(bad, profile="x")


def test_smollm2_config_is_studies_2_to_5_with_two_seeds_at_the_teachers_length():
    cfg = StudyConfig.from_file(SMOLLM2)
    assert cfg.teacher == "smollm2-135m" and cfg.seeds == (0, 1) and cfg.parallel == 6
    assert {s for v in cfg.variants for s in v.studies} == {2, 3, 4, 5, 7}
    by_study = {n: [v.name for v in cfg.variants if n in v.studies] for n in (3, 4, 5, 7)}
    assert by_study == {3: ["teacher", "teacher-tuned", "global-kv", "layerwise-3to1", "layerwise-7to1",
                            "token-swa1025"],
                        4: ["teacher", "teacher-tuned", "global-kv", "fusion-none", "fusion-gated-head"],
                        5: ["teacher", "teacher-tuned", "global-kv", "fa-rope"],  # global-kv: 7:1 / norm / NoPE
                        7: ["teacher", "teacher-tuned", "global-kv", "randglobal-kv", "learned-kv"]}
    assert cfg.variant("learned-kv").kind == "learned" and cfg.selector["batch_size"] == 2
    assert [v.name for v in cfg.variants if not v.trains] == ["teacher"]
    assert {v.name: cfg.seeds_of(v) for v in cfg.variants if 2 not in v.studies} == {
        n: (0,) for n in ("layerwise-3to1", "layerwise-7to1", "token-swa1025", "fusion-none", "fusion-gated-head",
                          "fa-rope", "learned-kv")}  # studies 3-5 and 7: one seed; study 2's rows: both
    assert cfg.seeds_of(cfg.variant("teacher-tuned")) == (0,)  # a reference row, not a strategy to spread
    assert all(cfg.seeds_of(v) == (0, 1) for v in cfg.variants if 2 in v.studies and v.trains
               and v.kind != "tuned_teacher")
    assert {(v.unit, v.fraction) for v in cfg.variants if v.kind == "select"} == {("head", 0.125), ("kv_group", 0.125)}
    assert [(s["name"], s["seq_len"]) for s in cfg.train["stages"]] == [("align", 2048), ("distill", 2048),
                                                                         ("long", 8192)]
    assert cfg.train["data"]["corpus"] == "data/corpus/train.txt"  # the same text as reference.toml
    items = eval_items(cfg, 8192)  # training_length(SmolLM2) = max_position_embeddings = 8192
    assert [n for n, *_ in items] == ["niah@2040", "niah@4088", "niah@8184", "niah_multikey", "reasoning",
                                     "perplexity"]  # capped at 1x: nothing past the teacher's positions
    assert dict((n, c) for n, _, c in items)["niah_multikey"]["lengths"] == (8184,)
    dry = StudyConfig.from_file(SMOLLM2, dry_run=True)
    assert dry.device == "cpu" and dry.seeds == (0,) and dry.teacher == "smollm2-135m"
    assert [v.name for v in dry.variants] == ["teacher", "global-kv", "fixed-kv", "randglobal-head", "token-swa1025",
                                              "learned-kv"]
    assert [s["seq_len"] for s in dry.train["stages"]] == [128, 128, 512]


def smollm2_shape():
    """A random Llama of SmolLM2-135M's attention shape (30 layers x 9 query heads, 3 KV heads), tiny widths:
    masks and KV shares depend only on that shape (the 135M GGUF is not loaded)."""
    from model_factories import tiny_model

    return tiny_model("llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=72,
                      head_dim=8)


def test_smollm2_variants_build_masks_of_the_budget_or_are_infeasible():
    import torch

    from research.studies.variants import InfeasibleVariant, build_variant

    cfg = StudyConfig.from_file(SMOLLM2)
    model = smollm2_shape()
    scores = torch.rand(30, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # [L, H]
    infeasible, built = set(), {}
    for spec in (v for v in cfg.variants if 2 in v.studies):
        try:
            built[spec.name] = build_variant(spec, model, scores=scores, seed=1, train_length=8192)
        except InfeasibleVariant:
            infeasible.add(spec.name)
    assert infeasible == {"gplm-kv", "fixed-head", "fixed-kv"}  # the rows smollm2.toml's comments name
    assert built.pop("teacher").mask is None
    tuned = built.pop("teacher-tuned")  # every head FA: the teacher's own KV cache
    assert len(tuned.mask.fa_heads) == 270 and tuned.info["kv_share"] == pytest.approx(1.0)
    for name, b in built.items():
        heads = b.mask.fa_heads
        groups = {(h.layer, h.head // 3) for h in heads}  # 3 query heads per KV group
        if cfg.variant(name).unit == "head":  # round(270 / 8) = 34 query heads
            assert len(heads) == 34 and b.info["fa_query_share"] == pytest.approx(34 / 270), name
            assert b.info["kv_share"] == pytest.approx(len(groups) / 90), name
        else:  # round(90 / 8) = 11 whole KV groups = 33 query heads
            assert len(groups) == 11 and len(heads) == 33, name
            assert b.info["kv_share"] == pytest.approx(11 / 90) and b.info["fa_query_share"] == pytest.approx(33 / 270)
    assert built["gplm-head"].info["layers_with_fa"] == 30 and built["perlayer-head"].info["layers_with_fa"] == 30
    assert built["perlayer-kv"].info["layers_with_fa"] == 11  # 0 per layer + 11 extra groups, one per layer


def test_smollm2_studies_3_to_5_build_hybrids_at_their_kv_share():
    """Every study 3-5 row of smollm2.toml builds a mask at the KV share its comment names (at the training length
    8192) and a hybrid that runs on a GQA Llama of SmolLM2's shape (Llama RoPE, no qk-norm, 3 heads per group)."""
    import torch

    from hybrid.convert import from_mask
    from research.studies.variants import build_variant

    cfg = StudyConfig.from_file(SMOLLM2)
    model = smollm2_shape()
    scores = torch.rand(30, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # [L, H]
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))  # [B, T]
    want = {  # name: (KV share at 8192, FA query share, layers with FA, options the kind / spec adds)
        "teacher-tuned": (1.0, 1.0, 30, {"merge": "none", "fa_gate": "none", "fa_rope": True}),
        "global-kv": (11 / 90, 33 / 270, None, {}),
        "layerwise-3to1": (8 / 30, 8 / 30, 8, {"granularity": "layer"}),  # round(30 / 4) = 8 layers, not 7.5
        "layerwise-7to1": (4 / 30, 4 / 30, 4, {"granularity": "layer"}),  # round(30 / 8) = 4 layers, not 3.75
        "token-swa1025": (1 / 8, 0.0, 0, {"granularity": "token", "window": 1025}),  # 1024 of 8192 positions
        "fusion-none": (11 / 90, 33 / 270, None, {"merge": "none"}),
        "fusion-gated-head": (11 / 90, 33 / 270, None, {"merge": "gated_head"}),
        "fa-rope": (11 / 90, 33 / 270, None, {"fa_rope": True, "fa_log_scale": False}),
    }
    specs = [v for v in cfg.variants if v.trains and {3, 4, 5} & set(v.studies)]
    assert [v.name for v in specs] == list(want)
    masks = {}
    for spec in specs:
        kv, q, layers, opts = want[spec.name]
        b = build_variant(spec, model, scores=scores, seed=0, train_length=8192)
        assert b.info["kv_share"] == pytest.approx(kv) and b.info["fa_query_share"] == pytest.approx(q), spec.name
        assert layers is None or b.info["layers_with_fa"] == layers, spec.name
        assert {k: b.options[k] for k in opts} == opts, spec.name
        masks[spec.name] = sorted(h.to_list() for h in b.mask.fa_heads)
        hybrid = from_mask(model, b.mask, **b.options)
        with torch.no_grad():
            logits = hybrid(ids).logits  # [B, T, V]
        assert logits.shape == (1, 24, model.config.vocab_size) and torch.isfinite(logits).all(), spec.name
    assert masks["global-kv"] == masks["fusion-none"] == masks["fusion-gated-head"] == masks["fa-rope"]
    assert {l for l, _ in masks["layerwise-7to1"]} == {7, 14, 21, 29}


def test_steps_scale_keeps_warmup_and_decay_inside_the_stage(tmp_path):
    cfg = StudyConfig.from_file(write(tmp_path, MINIMAL), steps_scale=0.1)
    a, d = cfg.train["stages"]
    assert (a["steps"], a["warmup_steps"]) == (1, 1) and (d["steps"], d["decay_steps"]) == (3, 2)


@pytest.mark.parametrize("extra, match", [
    ("color = 1\n", "unknown field"),
    ("[eval]\nfoo = 1\n", r"\[eval\]: unknown"),
    ("[eval.niah]\nn = 0\n", r"\[eval.niah\]"),
    ("[eval]\nevaluations = [\"ppl\"]\n", r"\[eval\].evaluations=\['ppl'\]: give a non-empty list"),
    ("[eval]\nevaluations = []\n", r"\[eval\].evaluations=\[\]"),
    ("[scores]\nsamples = 3\n", r"\[scores\]"),
    ("seeds = []\n", "seeds"),
    ("[[variants]]\nname = \"a\"\nfraction = 0.25\n", "used twice"),
    ("[selector]\nsteps = 0\n", r"\[selector\]: SelectorConfig.steps=0"),
    ("[selector]\nlambda = 1\n", r"\[selector\]: SelectorConfig: unknown field"),
])
def test_bad_configs_are_refused(tmp_path, extra, match):
    text = extra + MINIMAL if not extra.startswith("[") else MINIMAL + extra
    with pytest.raises(StudyError, match=match):
        StudyConfig.from_file(write(tmp_path, text))


def test_train_fields_set_by_the_study_are_refused(tmp_path):
    with pytest.raises(StudyError, match=r"\[train\]\.mask"):
        StudyConfig.from_file(write(tmp_path, MINIMAL.replace("[train]\n", "[train]\nmask = \"m.json\"\n")))
    with pytest.raises(StudyError, match="lr"):  # a bad stage is refused by hybrid.train's own checks
        StudyConfig.from_file(write(tmp_path, MINIMAL.replace("lr = 1e-3", "lr = -1", 1)))
    with pytest.raises(StudyError, match="steps_scale"):
        StudyConfig.from_file(write(tmp_path, MINIMAL), steps_scale=0)
    with pytest.raises(StudyError, match="no \\[dry_run\\]"):
        StudyConfig.from_file(write(tmp_path, MINIMAL), dry_run=True)


def test_eval_items_run_short_retrieval_first_and_long_niah_last():
    cfg = StudyConfig.from_file(CONFIG)
    items = eval_items(cfg, 2048)
    assert [n for n, *_ in items] == ["niah@2040", "niah_multikey", "reasoning", "perplexity", "niah@4088",
                                     "niah@8184", "niah@16376"]
    assert items[0][2]["lengths"] == (2040,) and "multiples" not in items[0][2]
    assert dict((n, c) for n, _, c in items)["perplexity"]["lengths"] == (2048,)


def test_eval_items_keep_only_the_chosen_evaluations(tmp_path):
    """[eval].evaluations: a study of some evaluations only (research/studies/tuned_teacher_long.toml measures
    perplexity alone), in the usual order."""
    full = eval_items(StudyConfig.from_file(write(tmp_path, MINIMAL)), 2048)
    cfg = StudyConfig.from_file(write(tmp_path, MINIMAL + '[eval]\nevaluations = ["perplexity", "niah"]\n'))
    items = eval_items(cfg, 2048)
    assert items == [i for i in full if i[1] in ("niah", "perplexity")] and {i[1] for i in items} == {"niah",
                                                                                                   "perplexity"}
    only = StudyConfig.from_file(ROOT / "research/studies/tuned_teacher_long.toml")
    assert [n for n, *_ in eval_items(only, 2048)] == ["perplexity"]


def rows():
    r = []
    for L, accs in ((2040, (1.0, 0.5)), (4088, (0.0, 0.5))):
        r += [{"evaluation": "niah", "metric": "accuracy", "value": a, "context_length": L, "status": "ok"} for a in accs]
    r.append({"evaluation": "niah", "metric": "accuracy", "value": None, "context_length": 8184, "status": "stopped"})
    r += [{"evaluation": "niah_multikey", "metric": "accuracy", "value": 0.25, "context_length": 2040, "status": "ok"}]
    r += [{"evaluation": "reasoning", "metric": "accuracy", "value": v, "family": f, "status": "ok"}
          for f, v in (("binding", 1.0), ("binding", 0.0), ("two_hop", 1.0))]
    r += [{"evaluation": "reasoning", "metric": "accuracy_teacher_forced", "value": 0.0, "family": "two_hop",
           "status": "ok"}]
    r += [{"evaluation": "perplexity", "metric": "perplexity", "value": 9.0, "context_length": 2048, "status": "ok"}]
    return r


def test_headline_metrics_from_rows():
    h = headline(rows(), 2048)
    assert h["niah"] == {"2040": 0.75, "4088": 0.25}  # the stopped 8184 row is no number
    assert h["multikey"] == 0.25 and h["reasoning_by_family"] == {"binding": 0.5, "two_hop": 1.0}
    assert h["reasoning"] == 0.75 and h["ppl"] == 9.0


def collected(dry_run=False):
    cfg = StudyConfig.from_file(CONFIG).to_dict()
    cfg.update(train_length=2048, dry_run=dry_run)
    info = {"kv_share": 0.125, "fa_query_share": 0.125, "layers_with_fa": 3, "gdn_state_bytes": 229376}
    runs = [{"name": "global-kv", "seed": s, "variant": next(v for v in cfg["variants"] if v["name"] == "global-kv"),
             "status": "done", "info": info, "train": {"capped": False}, "eval_items": {},
             "metrics": headline(rows(), 2048)} for s in (0, 1)]
    runs[1]["metrics"] = {**runs[1]["metrics"], "multikey": 0.75}
    runs.append({"name": "gplm-kv", "seed": 0, "variant": {}, "status": "infeasible", "reason": "needs k >= 8"})
    calls = [{"device": "cuda", "gpu": "NVIDIA H200", "seconds": 300.0, "finished": True, "command": "x"}]
    return {"config": cfg, "calls": calls, "runs": runs}


def test_study_table_rows_seeds_and_statuses():
    t = study_table(collected(), 2)
    row = t.set_index("variant").loc["global-kv"]
    assert row["NIAH 2040 (1x)"] == "0.75 ± 0.00" and row["NIAH 4088 (2x)"] == "0.25 ± 0.00"
    assert row["multi-key"] == "0.50 ± 0.35" and row["KV share"] == "0.125" and row["status"] == "done"
    assert row["what"] == "global, 1/8 of the KV groups"
    assert t.set_index("variant").loc["gplm-kv"]["status"] == "infeasible: needs k >= 8"
    assert t.set_index("variant").loc["teacher"]["status"] == "not run yet"
    tuned = study_table(collected(), 2).set_index("variant").loc["teacher-tuned"]  # the reference config's row
    assert tuned["what"] == "teacher, trained like the hybrids" and tuned["status"] == "not run yet"
    assert "GDN state (KiB)" in study_table(collected(), 3).columns
    md = to_markdown(t)
    assert md.splitlines()[0].startswith("| variant | what | NIAH 2040 (1x)") and len(md.splitlines()) == len(t) + 2


def test_markdown_block_says_how_it_was_made_and_fills_the_docs(tmp_path):
    block = markdown_block(collected(), command="python -m research.launch studies_reference")
    assert "5.0 GPU minutes" in block and "seeds [0]" in block and "### Study 5" in block
    assert "not a result" not in block and "not a result" in markdown_block(collected(True), command="c")
    doc = tmp_path / "results.md"
    doc.write_text(f"# Results\n{BEGIN}\nplaceholder\n{END}\ntail\n")
    update_docs(doc, block)
    text = doc.read_text()
    assert "placeholder" not in text and text.endswith(f"{END}\ntail\n") and "### Study 2" in text
    doc.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        update_docs(doc, block)
    doc.write_text(f"{BEGIN}\nkeep\n{END}\n<!-- cpu:begin -->\nold\n<!-- cpu:end -->\n")
    update_docs(doc, block, marker="cpu")
    text = doc.read_text()
    assert "keep" in text and "old" not in text and text.index("### Study 2") > text.index("<!-- cpu:begin -->")
    with pytest.raises(ValueError, match="<!-- gpu:begin -->"):
        update_docs(doc, block, marker="gpu")


def test_kernel_warmup_runs_a_hybrid_with_every_gdn_head_count(monkeypatch):
    """On the CPU it runs the torch twins; what it must do is build the hybrid and run training and decoding."""
    import hybrid.convert
    from headscope.reference import load_model
    from research.studies.runner import warm_kernels

    teacher, tok = load_model("default", device="cpu")
    built = []
    real = hybrid.convert.from_mask

    def spy(t, mask, **kw):
        built.append(mask)
        return real(t, mask, **kw)

    monkeypatch.setattr(hybrid.convert, "from_mask", spy)
    warm_kernels(teacher, tok, {"gdn_fold_heads": True}, seq_len=64)
    assert [len(built[0].fa_in_layer(l)) for l in range(8)] == list(range(8))


def test_a_variant_runs_with_its_own_seeds_a_subset_of_the_studys(tmp_path):
    cfg = StudyConfig.from_file(write(tmp_path, "seeds = [0, 1]\n" + MINIMAL))
    one = dataclasses.replace(cfg.variants[0], seeds=[1])
    assert one.seeds == (1,) and cfg.seeds_of(one) == (1,) and cfg.seeds_of(cfg.variants[0]) == (0, 1)
    assert one.to_dict()["seeds"] == [1] and VariantSpec.from_dict(one.to_dict()) == one
    with pytest.raises(StudyError, match="seeds \\[2\\] are not among the study's seeds"):
        StudyConfig.from_dict({**cfg.to_dict(), "variants": [{**one.to_dict(), "seeds": [2]}]})
    with pytest.raises(ValueError, match="seeds="):
        dataclasses.replace(cfg.variants[0], seeds=[])


def test_a_kind_without_new_parameters_trains_without_stage_1(tmp_path, tiny_qwen3):
    """The tuned teacher's folder gets a train.json without the stages that train only new parameters (it has
    none: the trainer would refuse such a stage); every other kind keeps the study's stages."""
    import json

    import torch

    from research.studies.runner import _prepare

    cfg = StudyConfig.from_file(write(tmp_path, MINIMAL + '[[variants]]\nname = "t"\nkind = "tuned_teacher"\n'))
    cfg = dataclasses.replace(cfg, train_length=64)  # run_study sets it from the teacher
    scores = torch.rand(tiny_qwen3.config.num_hidden_layers, tiny_qwen3.config.num_attention_heads)  # [L, H]
    for spec in cfg.variants:
        assert _prepare(cfg, tmp_path / "out", spec, 0, tiny_qwen3, scores=scores) is True
    stages = {v: [s["name"] for s in json.loads((tmp_path / "out" / "variants" / v / "seed0" / "train.json")
                                              .read_text())["stages"]] for v in ("a", "t")}
    assert stages == {"a": ["align", "distill"], "t": ["distill"]}


WORKER_WITH_CHILD = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1] + ".child", "w").write(str(child.pid))
def on_term(signum, frame):  # like a training worker checkpointing: its DataLoader workers must still be there
    time.sleep(0.3)
    open(sys.argv[1], "w").write("alive" if child.poll() is None else f"dead {child.poll()}")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[1] + ".ready", "w").write("1")
time.sleep(60)
"""


def test_a_stopped_worker_keeps_its_children_until_it_has_checkpointed_then_the_group_goes(tmp_path):
    """The runner's deadline SIGTERMs the worker alone (its DataLoader workers live on while it checkpoints the
    step under way), then SIGKILLs what is left of its process group."""
    import os
    import subprocess
    import sys
    import time

    from research.studies import runner

    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", WORKER_WITH_CHILD, str(flag)], preexec_fn=os.setsid)
    job = runner._Job(spec=VariantSpec(name="a", fraction=0.125), seed=0, proc=proc)
    end = time.time() + 30
    while not (tmp_path / "flag.ready").exists() and time.time() < end:
        time.sleep(0.05)
    child = int((tmp_path / "flag.child").read_text())
    runner._stop(job, "deadline")
    assert flag.read_text() == "alive" and job.status == "deadline"
    end = time.time() + 10
    while time.time() < end:  # the child, left behind by the worker, is killed with the group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the worker's child outlived the stop")
