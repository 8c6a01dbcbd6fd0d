"""research/count_decode_ops.py: the models it counts and its CPU report."""
import pytest

from hybrid.layers.hybrid_attention import GatedDeltaNetBranch
from research.count_decode_ops import build, main, tiny_teacher


def test_build_gives_the_split_and_the_fused_hybrid_and_refuses_other_names():
    teacher = tiny_teacher(layers=2)
    split = [m.decode_backend for m in build(teacher, "hybrid").modules() if isinstance(m, GatedDeltaNetBranch)]
    fused = [m.decode_backend for m in build(teacher, "hybrid_fused").modules()
             if isinstance(m, GatedDeltaNetBranch)]
    assert split == ["split"] * 2 and fused == ["fused"] * 2  # one GDN branch per layer
    assert not any(isinstance(m, GatedDeltaNetBranch) for m in build(teacher, "teacher").modules())
    with pytest.raises(ValueError, match="hybrid_fused"):
        build(teacher, "hybrid_7to1")


def test_breaks_with_the_fused_op_list_it_as_one_graph_on_the_cpu(capsys):
    res = main(["--breaks", "--fused-gdn", "--batch", "1"])
    for name in ("teacher", "hybrid", "hybrid_fused"):
        assert (res[f"{name} graph breaks"]["graphs"], res[f"{name} graph breaks"]["breaks"]) == (1, 0)
    assert "== hybrid_fused: torch.compile of the step: 1 graphs, 0 breaks" in capsys.readouterr().out
