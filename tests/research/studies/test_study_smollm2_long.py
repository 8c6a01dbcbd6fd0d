"""research/studies/smollm2_long.toml: study 5 (the FA branch) on the long recipe, judged by the fidelity and
fidelity_long suites. The config as written (three rows on one mask, their FA-branch options, the long recipe's data,
hybrid options, speed settings and four stages with fixed steps), its job (the broad corpus and the GGUF carried, the
teacher's text made first), and the tables past the teacher's length from hand-made rows."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from research.studies.config import StudyConfig

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "research" / "studies" / "smollm2_long.toml"
RECIPE = ROOT / "research" / "train_hybrid" / "smollm2_long.toml"
ROWS = ["nope-log", "rope-log", "rope"]


def test_the_config_has_three_fa_branches_on_one_mask():
    from hybrid.config import HybridOptions

    cfg = StudyConfig.from_file(CONFIG)
    assert [v.name for v in cfg.variants] == ROWS and cfg.seeds == (0,) and cfg.parallel == 1
    assert cfg.suites == ("fidelity", "fidelity_long")
    for v in cfg.variants:  # the same mask: causal global, 1/8 of the KV groups; study 5
        assert (v.kind, v.strategy, v.unit, v.fraction, v.studies) == ("select", "global", "kv_group", 0.125, (5,))
    branch = {v.name: {**cfg.hybrid, **v.hybrid} for v in cfg.variants}
    got = {n: (o["fa_rope"], o["fa_log_scale"], o["fa_gate"]) for n, o in branch.items()}
    assert got == {"nope-log": (False, True, "sigmoid2"), "rope-log": (True, True, "sigmoid2"),
                   "rope": (True, False, "sigmoid2")}
    for o in branch.values():
        HybridOptions(**o)  # valid options
    assert StudyConfig.from_dict(cfg.to_dict()).suites == cfg.suites  # study.json round trip


def test_the_rows_train_on_the_long_recipe_with_fixed_steps():
    from hybrid.train import TrainConfig

    cfg = StudyConfig.from_file(CONFIG)
    recipe = TrainConfig.from_file(RECIPE, mask="mask.json", out="run")
    method = cfg.variant("nope-log")
    tc = cfg.train_config("run", "mask.json", {**cfg.hybrid, **method.hybrid}, 0)
    assert tc.hybrid == recipe.hybrid  # the method's row is the recipe's hybrid
    assert tc.data == recipe.data and tc.teacher == recipe.teacher == "smollm2-135m"
    assert (tc.compile, tc.teacher_dtype, tc.compile_teacher) == (recipe.compile, recipe.teacher_dtype,
                                                                 recipe.compile_teacher)
    assert [s.name for s in tc.stages] == [s.name for s in recipe.stages] == ["align", "distill", "long", "long"]
    for mine, theirs in zip(tc.stages, recipe.stages):
        for f in ("lr", "seq_len", "batch_size", "warmup_steps", "weight_decay", "kl_weight", "ce_weight",
                  "temperature", "train_gdn_qkv", "align_inputs", "schedule", "decay_steps", "fused_loss", "data"):
            assert getattr(mine, f) == getattr(theirs, f), (mine.name, mine.seq_len, f)
        assert mine.max_minutes >= theirs.max_minutes  # a safety cap here; the steps end the stage
    # the study trains longer than the recipe (sized to one 30-minute lease): its rows need a machine held longer
    assert [s.steps for s in tc.stages] == [540, 420, 1300, 1100]
    assert [s.seq_len for s in tc.stages[2:]] == [16384, 32768] and {s.schedule for s in tc.stages[2:]} == {"constant"}
    assert all(s.data.text_windows == "documents" for s in tc.stages[2:])
    assert cfg.scores == {"n_samples": 16, "context_length": 1024, "haystack": "heldout", "sender_rounds": 3}


def test_the_job_resolves_and_carries_the_corpus_and_the_gguf(tmp_path, capsys):
    from research.launch import KINDS, Context, get_job
    from research.launch.__main__ import main as launch

    job = get_job("studies_smollm2_long")
    assert job.kind == "studies" and job.device == "cuda" and job.config == ("research/studies/smollm2_long.toml",)
    assert KINDS.entry("studies").needs(job) >= {"broad_corpus", "corpus", "gguf:smollm2-135m", "fla"}
    ctx = Context(out=tmp_path, configs=(tmp_path / "c.toml",), python="python", device="cuda")
    assert [s.name for s in KINDS.entry("studies").steps(job, ctx)] == ["teacher_text", "study", "tables"]
    assert launch(["studies_smollm2_long", "--dry-run", "--out", str(tmp_path / "r")]) in (0, None)
    assert "3 variants x seeds [0]" in capsys.readouterr().out


def test_the_carry_lists_the_corpus_and_the_gguf_parts(capsys):
    from research.stage import main as stage

    stage(["carry", "studies_smollm2_long"])
    out = capsys.readouterr().out
    assert ".stage/corpus.tar.xz.part" in out and ".stage/smollm2-135m.gguf.part" in out


# ---- the tables from hand-made rows ------------------------------------------------------------------------------
def _row(evaluation, metric, value, family=None, L=None, status="ok"):
    return {"evaluation": evaluation, "metric": metric, "value": value, "family": family, "context_length": L,
            "status": status}


def long_rows(niah32: float, grow: float) -> list[dict]:
    """fidelity_long rows: two sources at 8K/16K/32K (the teacher only at 8K), NIAH at 16K/32K/64K."""
    rows = []
    for src, base in (("prose", 20.0), ("code", 4.0)):
        for L, g in ((8192, 1.0), (16384, grow), (32768, grow * grow)):
            rows.append(_row("fidelity_long_text", "perplexity_student", base * g, src, L))
            rows.append(_row("fidelity_long_text", "perplexity_ratio_chunked", 0.9 * g, src, L))
            if L == 8192:
                rows += [_row("fidelity_long_text", "perplexity_ratio", 1.1 if src == "prose" else 1.2, src, L),
                         _row("fidelity_long_text", "top1_agreement", 0.85, src, L)]
            else:
                rows += [_row("fidelity_long_text", m, None, src, L, "not_applicable")
                         for m in ("perplexity_teacher", "perplexity_ratio", "kl_to_teacher", "top1_agreement")]
    for L, acc in ((16376, 1.0), (32760, niah32), (65528, 0.25)):
        for cell in ("pin+prose", "code+prose"):
            rows.append(_row("fidelity_long_niah", "accuracy_student", acc, cell, L))
            rows.append(_row("fidelity_long_niah", "accuracy_teacher", None, cell, L, "not_applicable"))
    rows.append(_row("fidelity_long_niah", "accuracy_student", float("nan"), "plain+prose", 65528, "skipped"))
    return rows


def fidelity_rows(ratio: float) -> list[dict]:
    return [_row("fidelity_text", "perplexity_ratio", ratio, "prose", 2048),
            _row("fidelity_text", "perplexity_ratio", 1.05, "code", 2048),
            _row("fidelity_text", "top1_agreement", 0.82, "prose", 2048),
            _row("fidelity_text", "top1_agreement", 0.80, "code", 2048)]


def test_the_long_headline_from_rows():
    from research.studies.metrics import long_headline

    h = long_headline(long_rows(0.75, 0.95))
    assert h["perplexity"]["prose"] == pytest.approx({"8192": 20.0, "16384": 19.0, "32768": 20 * 0.95 ** 2})
    assert list(h["perplexity"]) == ["prose", "code"]
    assert h["perplexity_ratio"] == {"prose": {"8192": 1.1}, "code": {"8192": 1.2}}  # the teacher within 8K only
    assert h["top1_agreement"]["code"] == {"8192": 0.85}
    assert h["niah"] == {"16376": {"student": 1.0, "teacher": None}, "32760": {"student": 0.75, "teacher": None},
                         "65528": {"student": 0.25, "teacher": None}}  # the skipped cell left out
    assert h["perplexity_ratio_chunked"]["code"]["32768"] == pytest.approx(0.9 * 0.95 ** 2)
    empty = long_headline([])
    assert empty["niah"] == {} and empty["perplexity"] == {}


def collected_by_hand() -> dict:
    from research.studies.metrics import fidelity_headline, long_headline

    cfg = StudyConfig.from_file(CONFIG).to_dict()
    cfg["train_length"] = 8192
    info = {"kv_share": 0.122, "fa_query_share": 0.122, "layers_with_fa": 9, "gdn_state_bytes": 0}
    both = {"fidelity": {}, "fidelity_long": {}}
    runs = [{"name": "nope-log", "seed": 0, "status": "done", "info": info, "suites": both,
             "metrics": {"niah": {"8184": 1.0}, "multikey": 0.9, "reasoning": 0.5, "perplexity": {}, "ppl": 12.0},
             "fidelity": {"fidelity": fidelity_headline(fidelity_rows(1.10))},
             "long": {"fidelity_long": long_headline(long_rows(0.85, 0.9))}},
            {"name": "rope-log", "seed": 0, "status": "done", "info": info, "suites": both,
             "fidelity": {"fidelity": fidelity_headline(fidelity_rows(1.30))},
             "long": {"fidelity_long": long_headline(long_rows(0.25, 1.4))}},
            {"name": "rope", "seed": 0, "status": "evaluation unfinished", "info": info, "suites": {"fidelity": {}},
             "fidelity": {"fidelity": fidelity_headline(fidelity_rows(1.10))},
             "long": {"fidelity_long": long_headline([])}}]
    return {"config": cfg, "calls": [], "runs": runs}


def test_the_long_table_shows_niah_perplexity_and_fidelity_per_row():
    from research.studies.metrics import long_table

    df = long_table(collected_by_hand(), "fidelity_long", "fidelity").set_index("variant")
    assert list(df.index) == ROWS
    for col in ("NIAH 16K", "NIAH 32K", "NIAH 64K", "ppl 8K", "ppl 16K", "ppl 32K", "ppl 16K / 8K (worst source)",
                "ppl 32K / 8K (worst source)", "ppl ratio (worst source)", "top-1 agreement",
                "ppl ratio 8K (worst source)", "top-1 8K", "targets met", "KV share", "status"):
        assert col in df.columns, col
    m = df.loc["nope-log"]
    assert (m["NIAH 16K"], m["NIAH 32K"], m["NIAH 64K"]) == ("1.00", "0.85", "0.25")
    assert m["ppl 8K"] == "12.00" and m["ppl 32K / 8K (worst source)"] == "0.810"
    assert (m["ppl ratio (worst source)"], m["top-1 agreement"]) == ("1.100", "0.810")
    assert (m["ppl ratio 8K (worst source)"], m["top-1 8K"]) == ("1.200", "0.850")
    assert m["targets met"] == "4 of 5: NIAH 32K >= 0.8, ppl past 8K <= at 8K, ppl ratio <= 1.15, top-1 >= 0.8"
    r = df.loc["rope-log"]
    assert r["ppl 16K / 8K (worst source)"] == "1.400" and r["targets met"] == "1 of 5: top-1 >= 0.8"
    assert df.loc["rope", "NIAH 32K"] == "-" and df.loc["rope", "targets met"] == "-" and "suite finished on 0 of 1 runs" in df.loc["rope", "status"]
    alone = long_table(collected_by_hand(), "fidelity_long").set_index("variant")  # no fidelity suite: 8K rows
    assert "ppl ratio (worst source)" not in alone.columns
    assert alone.loc["nope-log", "targets met"].startswith("3 of 5")  # 1.2 > 1.15 at 8K


def test_the_same_tokens_ratio_judges_the_past_8k_target_where_the_rows_have_it():
    """Rows with long_context_ratio (the same tokens read whole / in chunks of the teacher's positions) add a column
    per length past the teacher's and decide "ppl past 8K <= at 8K" instead of other windows' growth."""
    from research.studies.metrics import long_headline, long_table

    collected = collected_by_hand()
    rows = long_rows(0.85, 0.9)  # growth 0.9 and 0.81: met by the windows' growth
    for src, worse in (("prose", 1.02), ("code", 0.97)):
        rows += [_row("fidelity_long_text", "long_context_ratio", 1.0, src, 8192),
                 _row("fidelity_long_text", "long_context_ratio", worse, src, 16384),
                 _row("fidelity_long_text", "long_context_ratio", 0.95, src, 32768)]
    collected["runs"][0]["long"]["fidelity_long"] = long_headline(rows)
    assert collected["runs"][0]["long"]["fidelity_long"]["long_context_ratio"]["prose"]["16384"] == 1.02
    m = long_table(collected, "fidelity_long", "fidelity").set_index("variant").loc["nope-log"]
    assert (m["ppl 16K whole / chunked (worst source)"], m["ppl 32K whole / chunked (worst source)"]) == (
        "1.020", "0.950")
    assert "ppl 8K whole / chunked (worst source)" not in m.index  # the teacher's own length: 1 by definition
    assert m["targets met"] == "3 of 5: NIAH 32K >= 0.8, ppl ratio <= 1.15, top-1 >= 0.8"


def test_the_perplexity_table_per_source_and_the_markdown_block():
    from research.studies.metrics import long_perplexity_table, markdown_block

    df = long_perplexity_table(collected_by_hand(), "fidelity_long")
    assert [tuple(x) for x in df[["variant", "source"]].values] == [("nope-log", "prose"), ("nope-log", "code"),
                                                                    ("rope-log", "prose"), ("rope-log", "code")]
    assert list(df.columns) == ["variant", "source", "ppl 8K", "ppl 16K", "ppl 32K", "16K / 8K", "32K / 8K",
                                "/ teacher chunked 32K"]
    code = df[(df["variant"] == "rope-log") & (df["source"] == "code")].iloc[0]
    assert (code["ppl 8K"], code["ppl 32K"], code["32K / 8K"]) == ("4.00", f"{4 * 1.96:.2f}", "1.960")
    assert code["/ teacher chunked 32K"] == f"{0.9 * 1.96:.3f}"

    block = markdown_block(collected_by_hand(), command="c")
    assert "### Study 5: FA branch" in block and "### Fidelity to the teacher (suite `fidelity`)" in block
    assert "### Past the teacher's length (suite `fidelity_long`; fidelity within it: suite `fidelity`)" in block
    assert "### Held-out perplexity by source (suite `fidelity_long`)" in block
    assert "NIAH >= 0.8 at 32K, >= 0.5 at 64K" in block
    long = block.split("### Past the teacher's length")[1].split("###")[0]
    assert [line.split(" | ")[0] for line in long.strip().splitlines()[4:7]] == [f"| {n}" for n in ROWS]
    labels = block.split("### Study 5")[1].split("###")[0]
    assert "fa_rope=False, fa_log_scale=True" in labels and "fa_rope=True, fa_log_scale=False" in labels
    other = dict(collected_by_hand())
    other["config"] = {**other["config"], "suite": "fidelity"}  # without fidelity_long: no such tables
    assert "Past the teacher's length" not in markdown_block(other, command="c")


def test_collect_and_render_read_the_long_suite_from_a_study_folder(tmp_path, capsys):
    """A study folder written by hand as the worker leaves it: collect() reads each suite's rows (a suite cut short
    from its parts), render_studies writes the tables past the teacher's length."""
    import json

    from research.studies.config import SUITES_FILE, variant_dir
    from research.studies.render_studies import main as render
    from research.studies.runner import collect

    cfg = StudyConfig.from_file(CONFIG).to_dict()
    cfg["train_length"] = 8192
    out = tmp_path / "study"
    out.mkdir()
    (out / "study.json").write_text(json.dumps(cfg))
    info = {"kv_share": 0.122, "fa_query_share": 0.122, "layers_with_fa": 9, "gdn_state_bytes": 0}
    for name, niah32 in (("nope-log", 0.9), ("rope-log", 0.1)):
        d = variant_dir(out, name, 0)
        d.mkdir(parents=True)
        (d / "variant.json").write_text(json.dumps({"info": info}))
        (d / "train_done.json").write_text(json.dumps({"capped": False}))
        (d / "result.json").write_text("{}")
        (d / SUITES_FILE).write_text(json.dumps({"fidelity": {}, "fidelity_long": {}}))
        for suite, rows in (("fidelity", fidelity_rows(1.1)), ("fidelity_long", long_rows(niah32, 0.9))):
            (d / suite).mkdir()
            (d / suite / "results.json").write_text(json.dumps({"rows": rows}))
    cut = variant_dir(out, "rope", 0)  # cut during fidelity_long: its text evaluation saved, NIAH not yet
    (cut / "fidelity_long_parts" / "fidelity_long_text").mkdir(parents=True)
    (cut / "variant.json").write_text(json.dumps({"info": info}))
    (cut / "train_done.json").write_text("{}")
    (cut / SUITES_FILE).write_text(json.dumps({"fidelity": {}}))
    text = [r for r in long_rows(0.0, 1.2) if r["evaluation"] == "fidelity_long_text"]
    (cut / "fidelity_long_parts" / "fidelity_long_text" / "results.json").write_text(json.dumps({"rows": text}))

    runs = {r["name"]: r for r in collect(out)["runs"]}
    assert runs["nope-log"]["long"]["fidelity_long"]["niah"]["32760"]["student"] == 0.9
    assert set(runs["nope-log"]["long"]) == {"fidelity_long"} and runs["nope-log"]["status"] == "done"
    assert runs["rope"]["long"]["fidelity_long"]["niah"] == {}
    assert runs["rope"]["long"]["fidelity_long"]["perplexity"]["code"]["32768"] == pytest.approx(4 * 1.44)
    assert render(["--run", str(out), "--out", str(tmp_path / "r"), "--command", "c"]) == 0
    tables = (tmp_path / "r" / "tables.md").read_text()
    long = tables.split("### Past the teacher's length")[1].split("###")[0]
    assert "| nope-log |" in long and "| 0.90 |" in long and "suite finished on 0 of 1 runs" in long
    assert "| rope | code | 4.00 |" in tables.split("### Held-out perplexity by source")[1]
