"""research/perf/gdn_step_sweep.py: its grid, cells, refusals and inputs (the timing itself needs a GPU), and the
tuning arguments of hybrid.ops.gdn_decode.gdn_decode_step_triton it sweeps."""
import pytest
import torch

from hybrid.ops.gdn_decode import BLOCK_V, gdn_decode_step_reference, gdn_decode_step_triton
from research.perf.gdn_step_sweep import DEFAULT, inputs, main


def test_dry_run_lists_the_cells_and_the_default_tuning_first_once():
    res = main(["--dry-run", "--batches", "1", "8", "--block-v", "32", "64", "--num-warps", "4", "--num-stages", "2"])
    assert res["cells"] == [(8, 14), (1, 14)]
    assert res["tunings"][0] == DEFAULT == dict(block_v=BLOCK_V, num_warps=None, num_stages=None)
    assert res["tunings"].count(DEFAULT) == 1 and len(res["tunings"]) == 3


@pytest.mark.parametrize("argv, message", [(["--block-v", "48"], "powers of two"), (["--block-v", "256"], "to 128"),
                                           (["--heads", "0"], "positive")])
def test_bad_arguments_are_refused_with_the_rule(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["--dry-run", *argv])
    assert message in capsys.readouterr().err


def test_the_inputs_are_the_steps_and_a_bad_tuning_is_refused_first():
    args, kw = inputs(2, 3, device="cpu")
    q, state = args[0], args[5]
    assert q.shape == (2, 1, 3, 128) and q.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert q.stride(-1) == 1 and not q.is_contiguous()  # views of one fused projection, as in decoding
    out = gdn_decode_step_reference(*args, **kw)
    assert out.shape == (2, 1, 3, 128) and torch.isfinite(out.float()).all()
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        gdn_decode_step_triton(*args, **kw, block_v=24)
