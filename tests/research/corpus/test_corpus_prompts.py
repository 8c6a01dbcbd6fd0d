"""research.corpus.prompts: the self-distillation instructions never overlap the held-out chat instructions."""
from __future__ import annotations

import json

import pytest

from research.corpus import prompts as P


def test_instructions_are_distinct_and_cover_every_topic_and_kind():
    rows = P.instructions()
    assert len(rows) == len({P.normalize(r.text) for r in rows}) > 10_000
    assert {r.topic for r in rows} == set(P.TOPICS) and {r.kind for r in rows} == set(P.KINDS)
    assert P.instructions() == rows and len(P.prompt_set_id(rows)) == 16  # a fixed order


@pytest.mark.skipif(not P.CHAT_HELDOUT.exists(), reason="the held-out chat instructions are not there")
def test_no_overlap_with_the_heldout_chat_instructions():
    held = P.heldout_chat()
    rows = P.instructions()
    assert held
    assert not {P.normalize(h["instruction"]) for h in held} & {P.normalize(r.text) for r in rows}
    assert not {h["topic"].lower() for h in held} & {t.lower() for t in P.TOPICS}  # held-out topics excluded
    P.check_heldout(rows)


def test_check_heldout_refuses_shared_text_and_topics(tmp_path):
    rows = P.instructions()[:50]
    f = tmp_path / "held.jsonl"
    f.write_text(json.dumps({"instruction": rows[3].text.upper() + "!", "topic": "cooking", "kind": "x"}) + "\n")
    with pytest.raises(P.HeldOutOverlapError, match="overlaps a held-out chat instruction"):
        P.check_heldout(rows, f)
    f.write_text(json.dumps({"instruction": "Something else entirely here.", "topic": rows[0].topic.upper(),
                             "kind": "x"}) + "\n")
    with pytest.raises(P.HeldOutOverlapError, match="held-out chat topics"):
        P.check_heldout(rows, f)
    assert P.check_heldout(rows, tmp_path / "missing.jsonl") is None  # nothing to check against yet
