"""The notebooks run top to bottom (on the demo folder and SmolLM2-135M) and are committed without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_every_notebook_is_found() -> None:
    assert {nb.name for nb in NOTEBOOKS} == {
        "quickstart.ipynb",
        "langchain.ipynb",
        "llamaindex.ipynb",
        "agentic_rag.ipynb",
    }


@pytest.mark.smollm2
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), f"{path.name} has outputs"
    resources = {"metadata": {"path": str(path.parent)}}  # run from notebooks/, as a user would
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources=resources).execute()
    errors = [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors
    assert all(cell.execution_count is not None for cell in code)
