"""research/perf/greedy_batching.py runs on the CPU at a tiny size and reports the same tokens both ways."""
from __future__ import annotations

import pytest

from research.perf import greedy_batching


@pytest.mark.e2e  # loads the reference model and builds its hybrid (~10 s)
def test_both_ways_give_the_same_tokens(capsys):
    res = greedy_batching.main(["--prompts", "4", "--min-len", "8", "--max-len", "12", "--new", "4", "--repeats", "1"])
    assert res["same_tokens"] is True and res["own_rows_s"] > 0 and res["equal_length_s"] > 0
    assert "'ratio'" in capsys.readouterr().out


def test_bad_lengths_say_how():
    with pytest.raises(SystemExit):
        greedy_batching.main(["--min-len", "9", "--max-len", "3"])
