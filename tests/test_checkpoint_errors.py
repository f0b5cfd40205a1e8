"""A broken checkpoint fails with a ValueError that names the tensor (official name) or file."""
import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from dsflash.checkpoint import SafetensorsFile, load_checkpoint, write_safetensors
from dsflash.checkpoint.synth import random_stored_params, write_synthetic_checkpoint
from dsflash.config import preset

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    cfg = preset("tiny")
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("pristine"), cfg, params=random_stored_params(cfg, 1),
                                      tokenizer=False)


@pytest.fixture
def ckpt(tmp_path, pristine):
    out = tmp_path / "ckpt"
    shutil.copytree(pristine, out)
    return out


def weight_map(folder):
    with open(folder / INDEX) as f:
        return json.load(f)["weight_map"]


def set_weight_map(folder, wm):
    with open(folder / INDEX) as f:
        index = json.load(f)
    index["weight_map"] = wm
    with open(folder / INDEX, "w") as f:
        json.dump(index, f)


def rewrite_shard_of(folder, tensor, edit):
    """Rewrite the shard holding ``tensor``: ``edit(list of (name, array, st_dtype)) -> list``."""
    fname = weight_map(folder)[tensor]
    path = folder / fname
    st = SafetensorsFile(path)
    items = [(n, np.array(st.get(n)), st.tensors[n].dtype) for n in st.keys()]
    st.close()
    del st
    items = edit(items)
    write_safetensors(str(path) + ".tmp", items, metadata={"format": "pt"})
    os.replace(str(path) + ".tmp", path)
    return fname


def load(folder):
    return load_checkpoint(folder, progress=False)


def test_pristine_loads(pristine):
    load(pristine)


def test_check_cli(pristine, ckpt, capsys):
    """python -m dsflash.checkpoint FOLDER validates from headers; exit 1 with the loader's message."""
    from dsflash.checkpoint.__main__ import main
    assert main([pristine]) == 0
    assert '"ignored_vision": 5' in capsys.readouterr().out
    os.remove(ckpt / weight_map(ckpt)["norm.weight"])
    assert main([str(ckpt)]) == 1
    assert "is missing" in capsys.readouterr().err


def test_missing_tensor(ckpt):
    name = "layers.2.attn.wkv.scale"
    rewrite_shard_of(ckpt, name, lambda items: [i for i in items if i[0] != name])
    wm = weight_map(ckpt)
    del wm[name]
    set_weight_map(ckpt, wm)
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.2\.attn\.wkv\.scale'"):
        load(ckpt)


def test_missing_expert(ckpt):
    name = "layers.4.ffn.experts.6.w2.weight"
    wm = weight_map(ckpt)
    del wm[name]
    set_weight_map(ckpt, wm)
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.4\.ffn\.experts\.6\.w2\.weight'"):
        load(ckpt)


def test_extra_tensor(ckpt):
    name = "layers.0.attn.wq_c.weight"
    fname = rewrite_shard_of(ckpt, "layers.0.attn_norm.weight",
                             lambda items: items + [(name, np.zeros(4, ml_dtypes.bfloat16), "BF16")])
    wm = weight_map(ckpt)
    wm[name] = fname
    set_weight_map(ckpt, wm)
    with pytest.raises(ValueError, match=r"unexpected tensor 'layers\.0\.attn\.wq_c\.weight'"):
        load(ckpt)


def test_extra_expert(ckpt):
    """An expert index beyond n_routed_experts (a checkpoint of a bigger model) is an extra tensor."""
    wm = weight_map(ckpt)
    wm["layers.0.ffn.experts.8.w1.weight"] = wm["layers.0.ffn.experts.7.w1.weight"]
    set_weight_map(ckpt, wm)
    with pytest.raises(ValueError, match=r"'layers\.0\.ffn\.experts\.8\.w1\.weight'"):
        load(ckpt)


def test_wrong_shape(ckpt):
    name = "layers.2.attn.wq_b.weight"

    def edit(items):
        return [(n, a[: a.shape[0] // 2] if n == name else a, d) for n, a, d in items]
    rewrite_shard_of(ckpt, name, edit)
    with pytest.raises(ValueError, match=r"'layers\.2\.attn\.wq_b\.weight'.*shape \[256, 64\], expected \[512, 64\]"):
        load(ckpt)


def test_wrong_shape_expert(ckpt):
    name = "mtp.0.ffn.experts.3.w3.scale"
    rewrite_shard_of(ckpt, name, lambda items: [(n, a.T.copy() if n == name else a, d) for n, a, d in items])
    with pytest.raises(ValueError, match=r"'mtp\.0\.ffn\.experts\.3\.w3\.scale'.*shape"):
        load(ckpt)


@pytest.mark.parametrize("name,new", [("layers.0.attn_norm.weight", "F32"),      # BF16 stored as F32
                                      ("layers.3.attn.wo_b.scale", "U8"),       # E8M0 bytes as plain U8
                                      ("layers.3.ffn.experts.0.w1.weight", "U8"),  # MXFP4 nibbles as U8
                                      ("embed.weight", "F16")])
def test_wrong_dtype(ckpt, name, new):
    def edit(items):
        out = []
        for n, a, d in items:
            if n == name:
                a = a.astype(np.float32) if new == "F32" else (a.view(np.uint8) if new == "U8" else a.view(np.float16))
                d = new
            out.append((n, a, d))
        return out
    rewrite_shard_of(ckpt, name, edit)
    with pytest.raises(ValueError, match=rf"'{name}'.*stored as {new}"):
        load(ckpt)


def test_truncated_shard(ckpt):
    fname = weight_map(ckpt)["layers.3.ffn.experts.7.w2.weight"]
    path = ckpt / fname
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match=rf"{fname}.*truncated"):
        load(ckpt)


def test_truncated_header(ckpt):
    fname = weight_map(ckpt)["head.weight"]
    with open(ckpt / fname, "r+b") as f:
        f.truncate(40)
    with pytest.raises(ValueError, match=rf"{fname}.*truncated"):
        load(ckpt)


def test_garbled_header(ckpt):
    fname = weight_map(ckpt)["norm.weight"]
    with open(ckpt / fname, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe not json")
    with pytest.raises(ValueError, match=rf"{fname}.*not valid JSON"):
        load(ckpt)


def test_missing_shard_file(ckpt):
    fname = weight_map(ckpt)["mtp.0.main_proj.weight"]
    os.remove(ckpt / fname)
    with pytest.raises(ValueError, match=rf"shard file '{fname}' is missing"):
        load(ckpt)


def test_index_names_file_without_tensor(ckpt):
    wm = weight_map(ckpt)
    name = "layers.5.attn.indexer.wk.weight"
    other = next(f for f in sorted(set(wm.values())) if f != wm[name])
    wm[name] = other
    set_weight_map(ckpt, wm)
    with pytest.raises(ValueError, match=rf"'{name}'.*'{other}'.*no such tensor"):
        load(ckpt)


def test_no_checkpoint_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load(tmp_path / "empty")
    preset("tiny").save_json(tmp_path / "empty" / "config.json")
    with pytest.raises(ValueError, match="model.safetensors"):
        load(tmp_path / "empty")


def test_bad_config_json(ckpt):
    with open(ckpt / "config.json") as f:
        d = json.load(f)
    d["text_config"]["o_groups"] = 3
    with open(ckpt / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(ValueError, match=r"config\.json: ModelConfig\.o_groups"):
        load(ckpt)
    with open(ckpt / "config.json", "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match=r"config\.json: Expecting"):
        load(ckpt)


def test_config_mismatch(pristine):
    """Loading with the config of another model names a tensor that does not fit."""
    cfg = preset("tiny").replace(n_routed_experts=4)
    with pytest.raises(ValueError, match=r"unexpected tensor 'layers\.0\.ffn\.experts\.4\.w1\.(weight|scale)'"):
        load_checkpoint(pristine, cfg, progress=False)
    cfg = preset("tiny").replace(moe_intermediate_size=128)
    with pytest.raises(ValueError, match=r"'layers\.0\.ffn\.(shared_)?experts\.[^']*'.*shape"):
        load_checkpoint(pristine, cfg, progress=False)
