"""The example notebook runs top to bottom (its code cells, in order, in one namespace)."""
import json
import pathlib

NB = pathlib.Path(__file__).parent.parent / "examples" / "model_tour.ipynb"


def test_model_tour_notebook_runs(capsys):
    nb = json.loads(NB.read_text())
    ns: dict = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{NB.name}:{cell['id']}", "exec"), ns)
    out = capsys.readouterr().out
    assert "max |prefill - decode|" in out and "drafts" in out
    assert float(out.split("max |prefill - decode| =")[1].split()[0]) < 1e-4
