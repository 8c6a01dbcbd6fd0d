"""docs/quickstart.ipynb runs top to bottom on the CPU with the reference model and writes its mask."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from headscope.reference import has_default_weights  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[2] / "docs" / "quickstart.ipynb"

needs_weights = pytest.mark.skipif(not has_default_weights(), reason="the reference model's weights are not on disk")


def test_quickstart_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the notebook has no code cells"
    dirty = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None]
    assert not dirty, f"code cells {dirty} carry outputs: clear them before committing"


@needs_weights
def test_quickstart_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSCOPE_QUICKSTART_OUT", str(tmp_path))  # the kernel inherits the environment
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first failing cell

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    mask_file = tmp_path / "mask_7to1.json"
    assert mask_file.is_file(), "the notebook did not write mask_7to1.json"
    data = json.loads(mask_file.read_text())
    from headscope.mask import HeadMask

    mask = HeadMask.from_json(mask_file)
    assert len(mask.fa_heads) == 8 and mask.per_layer_counts() == [1] * 8, data  # 7:1 of 64 heads, >= 1 per layer
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if "application/vnd.plotly.v1+json" in o.get("data", {}) or "plotly" in o.get("data", {}).get("text/html", "")]
    assert len(shown) >= 2, "the heatmap and the knockout plot were not displayed"
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "finite: True" in text, "the hybrid's forward pass did not report finite logits"
