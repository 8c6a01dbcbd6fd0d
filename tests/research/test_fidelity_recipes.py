"""research.fidelity_recipes: several recipes' fidelity side by side (from the committed result folders)."""
from __future__ import annotations

from pathlib import Path

import pytest

from research import fidelity_recipes
from research.fidelity_seeds import read_rows, seed_table

ROOT = Path(__file__).resolve().parents[2] / "docs" / "results"
CAUSAL = [ROOT / f"2026-12-03_smollm2_broad_hybrid_fidelity_seed{s}" for s in (0, 1)]
RANDOM = ROOT / "2026-12-06_smollm2_broad_study_random_kv_h100"


def test_two_recipes_side_by_side_with_their_seed_means(tmp_path, capsys):
    spec = ["causal=" + ",".join(map(str, CAUSAL)), f"random={RANDOM}"]
    t = fidelity_recipes.main(spec + ["--out", str(tmp_path / "t.csv"), "--markdown", str(tmp_path / "t.md")])
    ref = seed_table({i: read_rows(p) for i, p in enumerate(CAUSAL)}).set_index(["line", "metric"])
    row = t.set_index(["line", "metric"]).loc[("chatterbot_dialogue", "perplexity_ratio")]
    assert row["causal_mean"] == pytest.approx(ref.loc[("chatterbot_dialogue", "perplexity_ratio"), "mean"])
    assert row["causal_seeds"] == 2 and row["random_seeds"] == 1 and row["target"] == "<= 1.15"
    assert row["causal"].startswith(f"{row['causal_mean']:.3f} +- ") and row["random"] == f"{row['random_mean']:.3f}"
    assert set(t.metric) == set(fidelity_recipes.HEADLINE)
    assert list(dict.fromkeys(t.metric)) == [m for m in fidelity_recipes.HEADLINE if m in set(t.metric)]
    md = (tmp_path / "t.md").read_text().splitlines()
    assert md[0] == "| line | metric | causal | random | target |" and len(md) == len(t) + 2
    assert "chat_nll_ratio" in capsys.readouterr().out


@pytest.mark.parametrize("spec, says", [("causal", "NAME=PATH"), ("=a.csv", "NAME=PATH"),
                                        ("x=/nonexistent/rows.csv", "no such file")])
def test_bad_recipes_say_how(spec, says, capsys):
    with pytest.raises(SystemExit):
        fidelity_recipes.main([spec])
    assert says in capsys.readouterr().err
