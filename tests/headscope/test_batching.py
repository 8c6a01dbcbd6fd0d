"""headscope.batching.micro_batches: chunks in order, halving on out-of-memory, errors that are not OOM."""
import pytest
import torch

from headscope.batching import is_oom, micro_batches


def _flaky(limit: int, seen: list, error=torch.OutOfMemoryError):
    def run(chunk):
        seen.append(len(chunk))
        if len(chunk) > limit:
            raise error("CUDA out of memory (simulated)")
        return [2 * j for j in chunk]
    return run


def test_chunks_cover_every_job_in_order():
    seen = []
    out = list(micro_batches(list(range(10)), _flaky(99, seen), 4))
    assert [list(c) for c, _ in out] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [r for _, r in out] == [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18]]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError])  # a CPU allocator raises RuntimeError
def test_oom_halves_and_keeps_the_smaller_size(error):
    seen, shrunk = [], []
    out = list(micro_batches(list(range(13)), _flaky(3, seen, error), 12, on_shrink=shrunk.append))
    assert seen[:3] == [12, 6, 3] and max(seen[2:]) <= 3  # 12 -> 6 -> 3, then kept for the rest
    assert shrunk == [6, 3]
    assert [j for c, _ in out for j in c] == list(range(13))  # every job once, in order
    assert [v for _, r in out for v in r] == [2 * j for j in range(13)]


def test_oom_at_size_one_and_other_errors_are_raised():
    with pytest.raises(torch.OutOfMemoryError):
        list(micro_batches([1, 2], _flaky(0, []), 2))
    with pytest.raises(ValueError, match="not memory"):
        list(micro_batches([1, 2], lambda c: (_ for _ in ()).throw(ValueError("not memory")), 2))
    seen = []
    with pytest.raises(RuntimeError, match="shape mismatch"):  # a RuntimeError that is not OOM: no retry
        list(micro_batches([1, 2], lambda c: seen.append(c) or (_ for _ in ()).throw(RuntimeError("shape mismatch")),
                           2))
    assert len(seen) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_batch_size(bad):
    with pytest.raises(ValueError, match="batch_size"):
        list(micro_batches([1], lambda c: c, bad))


def test_is_oom():
    assert is_oom(torch.OutOfMemoryError("x")) and is_oom(RuntimeError("CUDA out of memory. Tried"))
    assert not is_oom(RuntimeError("size mismatch")) and not is_oom(ValueError("out of memory"))
