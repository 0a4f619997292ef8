"""Every notebook runs top to bottom (tiny settings, JAXBACKEND_TINY=1) and
is stored with its outputs stripped.

The kernel is this very interpreter: a kernelspec written to a temporary
JUPYTER_PATH points at `sys.executable`, so the notebooks see the same
environment (and the same jaxbackend checkout) as the tests.
"""

import json
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "jaxbackend-tests"


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("jupyter")
    spec = home / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxbackend tests", "language": "python"}))
    saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "JAXBACKEND_TINY", "PYTHONPATH", "MPLBACKEND")}
    os.environ["JUPYTER_PATH"] = str(home)
    os.environ["JAXBACKEND_TINY"] = "1"
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + (saved["PYTHONPATH"] or "")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_there_are_four_notebooks():
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_", "04_"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, kernel_env, tmp_path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=300,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.get("output_type") == "error"]
    assert not errors
