"""loss.png: written with matplotlib, skipped with a warning without it (a finished run must not fail at its
last step for want of a plotting library, as it did before 2026-12-01)."""
import sys

import pytest

from dsflash.train import run

LOG = [{"stage": "target", "step": 0, "heldout_loss": 6.8}, {"stage": "target", "step": 1, "loss": 6.5},
       {"stage": "draft", "step": 1, "loss": 7.0, "ce": 6.4, "heldout_loss": 6.5}]


def test_loss_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "loss.png"
    run.plot_losses(str(path), LOG)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loss_plot_without_matplotlib_warns_and_writes_nothing(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib -> ImportError
    path = tmp_path / "loss.png"
    with pytest.warns(RuntimeWarning, match="matplotlib is not installed"):
        run.plot_losses(str(path), LOG)
    assert not path.exists()


def test_a_stage_that_did_not_run_gets_no_panel(tmp_path):
    """A chat-only run (SFT, no draft stage) is one panel wide; with a draft stage, two (PNG width from IHDR)."""
    import struct
    pytest.importorskip("matplotlib")
    sft = [{"stage": "sft", "step": 0, "heldout_chat_loss": 5.9, "heldout_loss": 3.0},
           {"stage": "sft", "step": 1, "loss": 4.8}]
    widths = {}
    for name, log in (("sft", sft), ("both", sft + LOG[2:])):
        path = tmp_path / f"{name}.png"
        run.plot_losses(str(path), log)
        widths[name] = struct.unpack(">I", path.read_bytes()[16:20])[0]
    assert widths["both"] == 2 * widths["sft"], widths
