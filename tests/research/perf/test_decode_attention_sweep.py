"""research/perf/decode_attention_sweep.py: its grid, cells and refusals (the timing itself needs a GPU), and the
tuning arguments of hybrid.ops.decode_attention.decode_attention_triton it sweeps."""
import pytest
import torch

from hybrid.ops.decode_attention import _n_splits, decode_attention_triton
from research.perf.decode_attention_sweep import DEFAULT, main


def test_dry_run_lists_the_cells_longest_first_and_the_default_tuning_first_once():
    res = main(["--dry-run", "--contexts", "32768", "131072", "--batches", "1", "8", "--block-n", "64", "128",
                "--waves", "2", "4", "--num-warps", "4", "--num-stages", "3"])
    assert res["cells"] == [(131072, 8, 1), (131072, 1, 1), (32768, 8, 1), (32768, 1, 1)]
    assert res["tunings"][0] == DEFAULT and res["tunings"].count(DEFAULT) == 1
    assert len(res["tunings"]) == 1 + 2 * 2 * 1 * 1  # the default (Triton's own warps / stages) is not in the grid


@pytest.mark.parametrize("argv, message", [(["--block-n", "48"], "powers of two"), (["--waves", "0"], "positive")])
def test_bad_arguments_are_refused_with_the_rule(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["--dry-run", *argv])
    assert message in capsys.readouterr().err


def test_the_kernel_refuses_a_bad_tuning_before_it_builds_anything():
    q = torch.zeros(1, 1, 2, 128)  # [B, 1, H, D]
    kv = torch.zeros(1, 64, 1, 128)  # [B, S, K, D]
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        decode_attention_triton(q, kv, kv, torch.tensor([64]), block_n=48)
    with pytest.raises(ValueError, match="waves >= 1"):
        decode_attention_triton(q, kv, kv, torch.tensor([64]), waves=0)


def test_splits_follow_the_waves_and_stop_at_one_per_block():
    q = torch.zeros(1)  # CPU: 8 "SMs"
    assert _n_splits(q, B=1, K=1, S=1 << 17) == 16  # 2 waves x 8
    assert _n_splits(q, B=1, K=1, S=1 << 17, waves=4) == 32
    assert _n_splits(q, B=1, K=1, S=256, waves=8, block_n=128) == 2  # at most one split per block of keys
    assert _n_splits(q, B=64, K=8, S=1 << 17) == 1
