"""Run a notebook's code cells in order in this Python process (no Jupyter needed: the device has none), printing
what they print. For measuring a notebook's numbers on the GPU: python tools/run_notebook.py
notebooks/performance_optimizations.ipynb (TFP8_NOTEBOOK_TINY=1 for the tiny sizes)."""
import json
import sys
from pathlib import Path


def run(path):
    path = Path(path)
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    namespace = {"__name__": "__main__"}
    for index, cell in enumerate(cells, 1):
        print(f"--- {path.name}: code cell {index} of {len(cells)}", flush=True)
        exec(compile("".join(cell["source"]), f"{path.name}[{index}]", "exec"), namespace)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/run_notebook.py NOTEBOOK.ipynb")
    run(sys.argv[1])
