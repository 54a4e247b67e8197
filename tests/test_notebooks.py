"""The notebooks: each file matches notebooks/make_notebooks.py, and each executes (nbclient) with tiny sizes
(TFP8_NOTEBOOK_TINY=1), on the CPU reference kernels when there is no GPU."""
import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NEEDS = {"llama_finetune.ipynb": ["transformers", "matplotlib"],
         "lora_finetune.ipynb": ["transformers", "matplotlib", "peft", "tqdm"]}


def generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", NOTEBOOKS / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_notebook_is_generated_and_up_to_date():
    make = generator()
    assert sorted(make.NOTEBOOKS) == sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    for name, cells in make.NOTEBOOKS.items():
        on_disk = nbformat.read(NOTEBOOKS / name, as_version=4)
        assert on_disk == make.build(cells), f"{name}: run python notebooks/make_notebooks.py"
        assert all(not cell.get("outputs") for cell in on_disk.cells), f"{name}: outputs must be empty"


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_executes_with_tiny_sizes(name, monkeypatch):
    for module in NEEDS.get(name, []):
        pytest.importorskip(module)
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("TFP8_NOTEBOOK_TINY", "1")  # the kernel process inherits it
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    outputs = [out for cell in notebook.cells for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
