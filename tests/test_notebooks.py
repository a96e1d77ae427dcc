"""The notebooks, executed top to bottom (the real pipeline inside), so they never rot. They are
kept in the repo without outputs; this test checks that too."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def kernel():
    """One kernel for every notebook, its variables emptied before each (%reset -f): a name a
    notebook does not define itself still fails it, and the imports are paid once, not four
    times (a kernel's start and its first cell's imports: ~10 s)."""
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(NOTEBOOKS[0].parent))
    yield manager
    manager.shutdown_kernel(now=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, tiny_model, kernel):
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        f"{path.name} is committed with outputs; clear them"
    notebook.cells.insert(0, nbformat.v4.new_code_cell("%reset -f"))
    NotebookClient(notebook, km=kernel, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "run report" in text


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "synthetic_data.ipynb"}
