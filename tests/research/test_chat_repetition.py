"""research/chat_repetition.py counts looping answers in a chat_answers.jsonl."""
from __future__ import annotations

import json

import pytest

from research import chat_repetition


def test_counts_the_looping_answers(tmp_path):
    f = tmp_path / "chat_answers.jsonl"
    rows = [{"teacher_answer": "The sky is blue because of scattering.", "student_answer": "a warm sea, " * 12},
            {"teacher_answer": "Three colours: red, green, blue.", "student_answer": "Red, green and blue."}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = chat_repetition.main([str(f), "--tokenizer", "default"])
    assert out["answers"] == 2
    assert out["teacher"]["answers_over_0.3"] == 0 and out["student"]["answers_over_0.3"] == 1
    assert out["student"]["mean_repeated_4grams"] > out["teacher"]["mean_repeated_4grams"]
    assert "ratio" not in out  # rows without the suite's per-instruction ratio


def test_the_ratio_without_loops_leaves_the_looping_pairs_out(tmp_path):
    f = tmp_path / "chat_answers.jsonl"
    rows = [{"teacher_answer": "The sky is blue because of scattering.", "student_answer": "a warm sea, " * 12,
             "ratio": 0.5},
            {"teacher_answer": "Three colours: red, green, blue.", "student_answer": "Red, green and blue.",
             "ratio": 2.0},
            {"teacher_answer": "Paris is the capital.", "student_answer": "It is Paris.", "ratio": 1.0}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = chat_repetition.main([str(f), "--tokenizer", "default"])
    assert out["ratio"] == {"n": 3, "mean": pytest.approx(3.5 / 3, abs=1e-3), "median": 1.0}
    assert out["ratio_no_loops"] == {"n": 2, "mean": 1.5, "median": 1.5}


def test_a_missing_file_says_how(tmp_path):
    with pytest.raises(SystemExit):
        chat_repetition.main([str(tmp_path / "nope.jsonl")])
