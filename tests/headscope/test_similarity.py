"""Layer similarity of the residual stream and per-layer head-score spread."""
import numpy as np
import pytest
import torch

from headscope.results import HeadScores
from headscope.similarity import adjacent_layer_similarity, head_score_spread, layer_similarity

from model_factories import tiny_model


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_layer_similarity_matrix(family):
    model = tiny_model(family)
    inputs = [torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    sim = layer_similarity(model, inputs)
    m = sim.to_numpy()
    assert sim.shape == (4, 4) and list(sim.index) == ["embed", "L0", "L1", "L2"]
    np.testing.assert_allclose(np.diag(m), 1.0, atol=1e-9)
    np.testing.assert_allclose(m, m.T, atol=1e-12)
    assert (m <= 1 + 1e-9).all() and (m >= -1 - 1e-9).all()
    # the last row is the last layer's raw output, not the final-normed hidden state
    with torch.no_grad():
        out = model(input_ids=inputs[0][None], output_hidden_states=True)
    h0, h1 = out.hidden_states[0][0].double(), out.hidden_states[1][0].double()
    one = torch.nn.functional.cosine_similarity(h0, h1, dim=-1).mean()
    single = layer_similarity(model, inputs[:1]).to_numpy()
    assert single[0, 1] == pytest.approx(float(one), abs=1e-9)
    adj = adjacent_layer_similarity(sim)
    assert list(adj.layer) == [0, 1, 2]
    np.testing.assert_allclose(adj.similarity, np.diag(m, 1))


def test_head_score_spread():
    s = HeadScores("t", torch.tensor([[[0.0, 0.5, 0.2, 0.05], [0.3, 0.3, 0.3, 0.3]]]))
    df = head_score_spread(s)
    assert list(df.layer) == [0, 1]
    assert df.loc[0, "range"] == pytest.approx(0.5) and df.loc[1, "range"] == pytest.approx(0.0)
    assert df.loc[0, "best_head"] == 1 and df.loc[0, "n_above"] == 2 and df.loc[1, "std"] == pytest.approx(0.0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="no inputs"):
        layer_similarity(tiny_model("qwen3"), [])
    with pytest.raises(ValueError, match="square"):
        adjacent_layer_similarity(np.zeros((2, 3)))
