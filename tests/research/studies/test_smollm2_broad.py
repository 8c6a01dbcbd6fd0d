"""research/studies/smollm2_broad.toml: the selection study's headline rows on the broad recipe, judged by the fidelity
suite. The config as written (the four rows and the teacher, defined as in smollm2.toml; the broad recipe's data,
speed settings and stages 1-2; the suite), its job (the broad corpus carried, the teacher's text made first), the
fidelity headline and table from rows; then a miniature of the study run through the runner on the CPU: a tiny
teacher, a tiny corpus manifest with the teacher's text, a few steps, the fidelity_smoke suite on every trained
variant, resumed per evaluation after a cut."""
from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest
from train_factories import write_broad_corpus

from research.studies.config import StudyConfig, StudyError, eval_items

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "research" / "studies" / "smollm2_broad.toml"
SELECTION = ROOT / "research" / "studies" / "smollm2.toml"
RECIPE = ROOT / "research" / "train_hybrid" / "smollm2_broad.toml"
ROWS = ["teacher", "teacher-tuned", "global-kv", "randglobal-kv", "layerwise-3to1", "layerwise-7to1"]


def test_the_config_has_the_four_headline_rows_on_the_broad_recipe():
    from hybrid.train import TrainConfig

    cfg = StudyConfig.from_file(CONFIG)
    assert [v.name for v in cfg.variants] == ROWS and cfg.seeds == (0,) and cfg.suites == ("fidelity",)
    assert cfg.parallel == 1
    selection = StudyConfig.from_file(SELECTION)
    for v in cfg.variants:  # each row defined as the selection study's row of the same name
        old = selection.variant(v.name)
        for f in ("kind", "strategy", "unit", "fraction", "ratio", "k", "window", "hybrid"):
            assert getattr(v, f) == getattr(old, f), (v.name, f)
    kinds = {v.name: (v.kind, v.strategy, v.unit) for v in cfg.variants}
    assert kinds["global-kv"] == ("select", "global", "kv_group") and kinds["teacher-tuned"][0] == "tuned_teacher"
    assert kinds["randglobal-kv"] == ("select", "random_global", "kv_group")
    assert cfg.variant("layerwise-3to1").ratio == "3:1"
    assert cfg.variant("layerwise-7to1").ratio == "7:1"  # the layer-wise row at about global-kv's KV share

    # the broad recipe's data, hybrid options, speed settings and stages 1-2 (fixed steps, the same for every row)
    recipe = TrainConfig.from_file(RECIPE, mask="mask.json", out="run")
    tc = cfg.train_config("run", "mask.json", cfg.hybrid, 0)
    assert tc.data == recipe.data
    assert tc.data.corpus == "data/corpus/manifest.json" and tc.data.teacher_corpus == "data/corpus/teacher"
    assert tc.hybrid == recipe.hybrid and tc.teacher == recipe.teacher == "smollm2-135m"
    assert (tc.compile, tc.teacher_dtype, tc.compile_teacher) == (recipe.compile, recipe.teacher_dtype,
                                                                 recipe.compile_teacher)
    assert [s.name for s in tc.stages] == [s.name for s in recipe.stages] == ["align", "distill"]
    for mine, theirs in zip(tc.stages, recipe.stages):
        for f in ("lr", "seq_len", "batch_size", "warmup_steps", "weight_decay", "kl_weight", "ce_weight",
                  "temperature", "train_gdn_qkv", "schedule", "decay_steps", "fused_loss"):
            assert getattr(mine, f) == getattr(theirs, f), (mine.name, f)
        assert mine.max_minutes >= theirs.max_minutes  # here a safety cap; the steps end the stage
    align, distill = tc.stages
    assert (align.steps, distill.steps) == (180, 260) and distill.steps * 64 * 2048 == 34_078_720
    # the recipe trains the same fixed steps: its hybrid is this study's global-kv row
    assert [(s.steps, s.max_minutes) for s in recipe.stages] == [(s.steps, s.max_minutes) for s in tc.stages]
    # the mask's scores as research/train_hybrid/run.py makes the broad recipe's (receiver + 3 sender rounds)
    assert cfg.scores == {"n_samples": 16, "context_length": 1024, "haystack": "heldout", "sender_rounds": 3}
    assert StudyConfig.from_dict(cfg.to_dict()).suite == "fidelity"  # study.json round trip
    # of the usual evaluations only the held-out perplexity: the fidelity suite judges the rows
    assert [name for name, *_ in eval_items(cfg, 8192)] == ["perplexity"]


def test_a_suite_is_checked_and_may_replace_the_usual_evaluations():
    data = tomllib.loads(CONFIG.read_text())
    with pytest.raises(StudyError, match="study.suite: unknown suite 'nope'"):
        StudyConfig.from_dict({**data, "suite": "fidelity,nope"})
    with pytest.raises(StudyError, match="study.suite"):
        StudyConfig.from_dict({**data, "suite": 3})
    alone = StudyConfig.from_dict({**data, "eval": {**data["eval"], "evaluations": []}})
    assert alone.suites == ("fidelity",)
    with pytest.raises(StudyError, match="empty only with a suite"):
        StudyConfig.from_dict({**data, "suite": "", "eval": {**data["eval"], "evaluations": []}})
    assert StudyConfig.from_file(SELECTION).suites == ()


def test_the_job_carries_the_broad_corpus_and_makes_the_teachers_text_first(tmp_path):
    from research.launch import KINDS, Context, get_job
    from research.launch import kinds

    job = get_job("studies_smollm2_broad")
    assert job.kind == "studies" and job.device == "cuda"
    assert KINDS.entry("studies").needs(job) >= {"broad_corpus", "corpus", "gguf:smollm2-135m", "fla"}
    ctx = Context(out=tmp_path, configs=(tmp_path / "c.toml",), python="python", device="cuda")
    steps = KINDS.entry("studies").steps(job, ctx)
    assert [s.name for s in steps] == ["teacher_text", "study", "tables"]
    assert steps[0].args[:4] == ("--model", "smollm2-135m", "--out", "data/corpus/teacher")
    data = tomllib.loads(CONFIG.read_text())["train"]["data"]
    step = kinds._teacher_text_steps(job, root=tmp_path, data=data)[0]
    assert step.when(None) is True  # no teacher.txt under this root: made first
    (tmp_path / "data" / "corpus" / "teacher").mkdir(parents=True)
    (tmp_path / "data" / "corpus" / "teacher" / "teacher.txt").write_text("x")
    assert step.when(None) is False
    # a study without a teacher corpus has no such step
    assert [s.name for s in KINDS.entry("studies").steps(get_job("studies_smollm2"), ctx)] == ["study", "tables"]


def test_one_lease_jobs_cover_every_row_but_the_broad_recipe_itself():
    """studies_smollm2_broad_{random,layerwise,layerwise_7to1,tuned}: the study's rows one lease at a time (--only), together every
    row but global-kv, which is the broad recipe's own hybrid (smollm2_broad_hybrid and _seed1); each stage-2 step is
    the recipe's 64 rows, in passes of 32 so that it fits an 80 GB card."""
    from research.launch import get_job

    only = []
    for name in ("random", "layerwise", "layerwise_7to1", "tuned"):
        job = get_job(f"studies_smollm2_broad_{name}")
        assert job.kind == "studies" and job.config == ("research/studies/smollm2_broad.toml",)
        only += job.args[job.args.index("--only") + 1].split(",")
    assert sorted(only) == sorted(set(ROWS) - {"global-kv"})
    cfg = StudyConfig.from_file(CONFIG)
    distill = cfg.train_config("run", "mask.json", cfg.hybrid, 0).stages[1]
    assert (distill.batch_size, distill.micro_batch_size) == (64, 32)
    assert get_job("smollm2_broad_hybrid").config == ("research/train_hybrid/smollm2_broad.toml",)


def _row(evaluation, metric, value, family=None, L=None, status="ok"):
    return {"evaluation": evaluation, "metric": metric, "value": value, "family": family, "context_length": L,
            "status": status}


def test_the_fidelity_headline_and_table_from_rows():
    from research.studies.metrics import fidelity_headline, fidelity_table, markdown_block

    def rows(k: float):
        return [_row("fidelity_text", "perplexity_ratio", 1.1 * k, "prose", 2048),
                _row("fidelity_text", "perplexity_ratio", 1.3 * k, "code", 2048),
                _row("fidelity_text", "kl_to_teacher", 0.1 * k, "prose", 2048),
                _row("fidelity_text", "kl_to_teacher", 0.3 * k, "code", 2048),
                _row("fidelity_text", "top1_agreement", 0.8, "prose", 2048),
                _row("fidelity_text", "top1_agreement", 0.6, "code", 2048),
                _row("fidelity_continuation", "continuation_agreement", 0.5, "prose", 256),
                _row("fidelity_continuation", "continuation_agreement", 0.3, "code", 256),
                _row("fidelity_chat", "chat_nll_ratio", 1.2 * k),
                _row("fidelity_chat", "chat_nll_ratio_median", 9.0),
                _row("fidelity_niah", "accuracy_student", 0.5, "pin+prose", 2040),
                _row("fidelity_niah", "accuracy_student", 1.0, "code+prose", 2040),
                _row("fidelity_niah", "accuracy_teacher", 1.0, "pin+prose", 2040),
                _row("fidelity_niah", "accuracy_teacher", 1.0, "code+prose", 2040),
                _row("fidelity_niah", "accuracy_student", float("nan"), "pin+prose", 8184, status="skipped")]

    h = fidelity_headline(rows(1.0))
    assert h["perplexity_ratio"] == {"prose": pytest.approx(1.1), "code": pytest.approx(1.3)}
    assert h["kl_to_teacher"] == pytest.approx(0.2) and h["top1_agreement"] == pytest.approx(0.7)
    assert h["continuation_agreement"] == pytest.approx(0.4) and h["chat_nll_ratio"] == pytest.approx(1.2)
    assert h["niah"] == {"2040": {"student": 0.75, "teacher": 1.0}}  # the skipped length left out
    assert fidelity_headline([])["chat_nll_ratio"] is None

    cfg = StudyConfig.from_file(CONFIG).to_dict()
    cfg["train_length"] = 8192
    info = {"kv_share": 0.122, "fa_query_share": 0.122, "layers_with_fa": 9, "gdn_state_bytes": 0}
    runs = [{"name": "teacher", "seed": 0, "status": "done", "metrics": None},
            {"name": "global-kv", "seed": 0, "status": "done", "info": info, "suites": {"fidelity": {}},
             "fidelity": {"fidelity": fidelity_headline(rows(1.0))}},
            {"name": "teacher-tuned", "seed": 0, "status": "evaluation unfinished", "info": info, "suites": {},
             "fidelity": {"fidelity": fidelity_headline(rows(1.0)[:2])}}]
    cfg["seeds"] = [0]
    collected = {"config": cfg, "calls": [], "runs": runs}
    df = fidelity_table(collected, "fidelity")
    assert list(df["variant"]) == ROWS[1:]  # every trained row, the teacher left out
    assert {"ppl ratio prose", "ppl ratio code", "KL to teacher", "top-1 agreement", "continuation agreement",
            "chat NLL ratio", "NIAH 2040 student / teacher", "KV share"} <= set(df.columns)
    g = df.set_index("variant").loc["global-kv"]
    assert (g["ppl ratio code"], g["top-1 agreement"], g["NIAH 2040 student / teacher"]) == ("1.300", "0.700",
                                                                                             "0.75 / 1.00")
    t = df.set_index("variant").loc["teacher-tuned"]
    assert t["chat NLL ratio"] == "-" and "suite finished on 0 of 1 runs" in t["status"]
    assert df.set_index("variant").loc["layerwise-3to1", "status"] == "not run yet"
    block = markdown_block(collected, command="c")
    assert "### Fidelity to the teacher (suite `fidelity`)" in block and "| global-kv |" in block
    other = {**collected, "config": {**cfg, "suite": "smoke"}}  # a suite without fidelity rows: no such table
    assert "Fidelity to the teacher" not in markdown_block(other, command="c")


def miniature(tmp_path: Path, teacher_dir: Path) -> StudyConfig:
    """The config with a tiny teacher, the test corpus, a few short steps, a tiny evaluation, fidelity_smoke."""
    manifest = write_broad_corpus(tmp_path / "corpus")
    d = tomllib.loads(CONFIG.read_text())
    d.update(teacher=str(teacher_dir), out=str(tmp_path / "st"), device="cpu", parallel=2, threads=1,
             suite="fidelity_smoke")
    d["scores"] = {"n_samples": 2, "context_length": 120, "haystack": "heldout", "sender_rounds": 1}
    d["train"].update(compile=False, teacher_dtype="float32", compile_teacher=False, log_every=1, checkpoint_every=0)
    d["train"]["data"].update(corpus=manifest, teacher_corpus=str(tmp_path / "corpus" / "teacher"), workers=0,
                              haystack="heldout")
    for s in d["train"]["stages"]:
        s.update(steps=2, seq_len=64, batch_size=2, warmup_steps=1, max_minutes=0.0)
        if "micro_batch_size" in s:  # the config's passes of 32 rows, here of 1: the two-pass step still runs
            s["micro_batch_size"] = 1
    d["eval"] = {"timeout_s": 120, "token_budget": 4096, "batch_size": 4,
                 "niah": {"lengths": [120], "depths": [0.5], "n": 1},
                 "niah_multikey": {"lengths": [120], "n_keys": [2], "n": 2}, "reasoning": {"n": 2},
                 "perplexity": {"lengths": [128], "n_windows": 2}}
    return StudyConfig.from_dict(d)


@pytest.mark.e2e  # worker processes: ~1.5 minutes on 2 idle cores
@pytest.mark.filterwarnings("ignore::UserWarning")  # the untrained tiny teacher's scores are noise: said, not checked
def test_a_miniature_study_runs_the_fidelity_suite_on_every_trained_row(tmp_path, ref_tokenizer, monkeypatch):
    from research.studies.metrics import markdown_block
    from research.studies.runner import collect, run_study, variant_dir
    from train_factories import save_tiny_teacher

    teacher_dir = save_tiny_teacher(tmp_path / "teacher", ref_tokenizer, num_hidden_layers=4)  # layer-wise 3:1: 1
    cfg = miniature(tmp_path, teacher_dir)
    out = tmp_path / "st"
    monkeypatch.setenv("HEADSCOPE_TEACHER_CACHE", str(tmp_path / "teacher_cache"))  # as overlap.sh sets it
    result = run_study(cfg, out=out, status_every=60)
    runs = {r["name"]: r for r in result["runs"]}
    assert {n: r["status"] for n, r in runs.items()} == {n: "done" for n in ROWS}
    # the workers share the teacher's side of the suite: a row started after another finished reads all of it
    counts = {name: [json.loads(f.read_text())["teacher_cache"]
                     for f in (variant_dir(out, name, 0) / "fidelity_smoke_parts").glob("*/results.json")]
              for name in ROWS[1:]}
    assert any(c and all(x["computed"] == 0 for x in c) and sum(x["read"] for x in c) > 0 for c in counts.values())
    assert any((tmp_path / "teacher_cache").glob("niah-*.json"))
    sources = ["shakespeare", "python_code", "python_docs", "postgresql_docs", "devils_dictionary",
               "chatterbot_dialogue", "lodash_code"]  # fidelity_text's: every shipped held-out source
    for name in ROWS[1:]:
        d = variant_dir(out, name, 0)
        rows = json.loads((d / "fidelity_smoke" / "results.json").read_text())["rows"]
        assert {r["evaluation"] for r in rows} == {"fidelity_text", "fidelity_continuation", "fidelity_chat",
                                                   "fidelity_niah"}
        assert json.loads((d / "suites.json").read_text())["fidelity_smoke"]["ok"] > 0
        assert json.loads((d / "result.json").read_text())["suites"]["fidelity_smoke"]["rows"] == len(rows)
        h = runs[name]["fidelity"]["fidelity_smoke"]
        assert list(h["perplexity_ratio"]) == sources and all(0.5 < x < 2 for x in h["perplexity_ratio"].values())
        assert 0 <= h["top1_agreement"] <= 1 and 0 <= h["continuation_agreement"] <= 1
        assert h["chat_nll_ratio"] is None  # the reference tokenizer has no chat template: chat rows skipped
        assert set(h["niah"]) == {"1016", "4088"}  # the tiny teacher has 4096 positions
        assert runs[name]["metrics"]["ppl"] > 1  # the usual evaluation too
    assert "fidelity" not in runs["teacher"] and not (variant_dir(out, "teacher", 0) / "fidelity_smoke").exists()
    tuned = json.loads((variant_dir(out, "teacher-tuned", 0) / "train.json").read_text())
    assert [s["name"] for s in tuned["stages"]] == ["distill"]  # the same distill tokens, no stage 1
    data = json.loads((variant_dir(out, "global-kv", 0) / "train.json").read_text())["data"]
    assert data["teacher_corpus"].endswith("teacher") and data["corpus"].endswith("manifest.json")

    block = markdown_block(collect(out), command="c")
    table = block.split("### Fidelity to the teacher (suite `fidelity_smoke`)")[1]
    for col in ("ppl ratio shakespeare", "ppl ratio lodash_code", "top-1 agreement", "continuation agreement",
                "chat NLL ratio", "NIAH 1016 student / teacher", "NIAH 4088 student / teacher"):
        assert col in table.splitlines()[2]
    assert [line.split(" | ")[0] for line in table.splitlines()[4:4 + len(ROWS) - 1]] == [f"| {n}" for n in ROWS[1:]]

    # a worker cut during its suite: the finished evaluations are read back, only the missing one runs
    d = variant_dir(out, "global-kv", 0)
    for f in ("result.json", "suites.json"):
        (d / f).unlink()
    shutil.rmtree(d / "fidelity_smoke_parts" / "fidelity_text")
    again = run_study(cfg, out=out, only=("global-kv",), status_every=60)
    log = (d / "worker.log").read_text()
    for name in ("fidelity_continuation", "fidelity_chat", "fidelity_niah_1016", "fidelity_niah_4088"):  # NIAH
        assert f"suite fidelity_smoke: {name} already done" in log  # is saved one length at a time
    assert log.count("suite fidelity_smoke: fidelity_text done") == 2
    assert {r["name"]: r["status"] for r in again["runs"]}["global-kv"] == "done"
