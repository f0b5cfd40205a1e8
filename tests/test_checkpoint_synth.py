"""python -m dsflash.checkpoint.synth (default weights = init_params) -> loader -> bit-identical params."""
import json
import os
import subprocess
import sys

import numpy as np

from dsflash.checkpoint import load_checkpoint
from dsflash.checkpoint.synth import main as synth_main
from dsflash.config import preset
from dsflash.model.params import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def same_bytes(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_synth_cli_default_weights(tmp_path):
    out = tmp_path / "cli"
    synth_main([str(out), "--preset", "tiny", "--seed", "0", "--no-vision", "--max-shard-bytes", str(4 << 20)])
    with open(out / "model.safetensors.index.json") as f:
        wm = json.load(f)["weight_map"]
    assert len(set(wm.values())) == 2 and not any(n.startswith("vision.") for n in wm)
    assert os.path.exists(out / "tokenizer.json") and os.path.exists(out / "tokenizer_config.json")
    cfg, loaded = load_checkpoint(out, progress=False)
    assert cfg == preset("tiny")
    ref = init_params(cfg, seed=0)
    assert set(ref) == set(loaded)
    for name, a in ref.items():
        assert same_bytes(loaded[name], a), name


def test_synth_module_entry_point(tmp_path):
    """The documented command line works as a module (help only: the weights path is tested above)."""
    r = subprocess.run([sys.executable, "-m", "dsflash.checkpoint.synth", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--preset" in r.stdout and "--seed" in r.stdout
