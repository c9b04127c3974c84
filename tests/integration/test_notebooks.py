"""The notebooks run top to bottom on small settings, and are committed executed, with their outputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest

if importlib.util.find_spec("ipykernel") is None:  # found, not imported: the kernel runs in its own process
    pytest.skip("the notebooks' kernel (ipykernel) is not installed", allow_module_level=True)

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = ("rounding_tour.ipynb", "growth_explorer.ipynb", "blame_tour.ipynb")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, tmp_path, monkeypatch):
    monkeypatch.setenv("SIMDIST_GROWTH_STEPS", "50")
    monkeypatch.setenv("SIMDIST_GROWTH_SEEDS", "2")
    monkeypatch.setenv("SIMDIST_GROWTH_OUT", str(tmp_path / "growth"))
    import nbclient  # in the dev extra: a missing one is an error, not a skip (imported here: slow tests only)

    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    if name == "growth_explorer.ipynb":
        assert (tmp_path / "growth" / "growth.png").exists()


MAX_BYTES = 400_000
"""Committed notebooks carry their outputs (one growth plot, a few tables): kept under this size."""


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_executed_with_outputs(name):
    """Readers see the results without running anything: every code cell ran, in order, without an error."""
    path = NOTEBOOKS / name
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    assert all(o.output_type != "error" for cell in code for o in cell.outputs)
    assert any("image/png" in o.get("data", {}) for cell in code for o in cell.outputs)
    assert path.stat().st_size < MAX_BYTES
