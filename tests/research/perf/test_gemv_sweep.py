"""research/perf/gemv_sweep.py: its grid, cells and refusals (the timing itself needs a GPU), and the tuning
arguments of hybrid.ops.gemv.decode_linear_triton it sweeps."""
import pytest
import torch

from hybrid.ops.gemv import BLOCK_K, BLOCK_N, decode_linear_triton
from research.perf.gemv_sweep import DEFAULT, SHAPES, main


def test_dry_run_lists_every_projection_and_the_default_tuning_first_once():
    res = main(["--dry-run", "--rows", "8", "1", "--block-n", "16", "32", "--block-k", str(BLOCK_K),
                "--num-warps", "4", "--num-stages", "4"])
    assert res["cells"] == [(name, r) for name in SHAPES for r in (1, 8)]
    assert res["tunings"][0] == DEFAULT and res["tunings"].count(DEFAULT) == 1
    assert DEFAULT["block_n"] == BLOCK_N and len(res["tunings"]) == 2  # the default is in this grid once
    assert SHAPES["head"] == (151936, 2048) and SHAPES["hybrid_in"][1] == 2048


@pytest.mark.parametrize("argv, message", [(["--block-k", "48"], "powers of two"), (["--rows", "9"], "1..8"),
                                           (["--shapes", "qkv"], "invalid choice")])
def test_bad_arguments_are_refused_with_the_rule(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["--dry-run", *argv])
    assert message in capsys.readouterr().err


def test_the_kernel_refuses_a_bad_tuning_before_it_builds_anything():
    with pytest.raises(ValueError, match="powers of two >= 16"):
        decode_linear_triton(torch.zeros(1, 64), torch.zeros(8, 64), block_k=48)
    with pytest.raises(ValueError, match="block_n=8"):
        decode_linear_triton(torch.zeros(1, 64), torch.zeros(8, 64), block_n=8)
