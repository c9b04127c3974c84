"""The notebooks run top to bottom on small settings, and are committed without outputs."""

from __future__ import annotations

from pathlib import Path

import nbclient  # in the dev extra: a missing one is an error, not a skip
import nbformat
import pytest

pytest.importorskip("ipykernel", reason="the notebooks' kernel (ipykernel) is not installed")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("rounding_tour.ipynb", "growth_explorer.ipynb")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, tmp_path, monkeypatch):
    monkeypatch.setenv("SIMDIST_GROWTH_STEPS", "50")
    monkeypatch.setenv("SIMDIST_GROWTH_SEEDS", "2")
    monkeypatch.setenv("SIMDIST_GROWTH_OUT", str(tmp_path / "growth"))
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    if name == "growth_explorer.ipynb":
        assert (tmp_path / "growth" / "growth.png").exists()


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
