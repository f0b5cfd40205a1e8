"""Synthetic official-layout checkpoint -> loader -> params bit-identical to the in-memory params."""
import json
import logging
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsflash.checkpoint import SafetensorsFile, load_checkpoint, write_safetensors
from dsflash.checkpoint.names import official_inventory
from dsflash.checkpoint.synth import random_stored_params, write_synthetic_checkpoint
from dsflash.config import ModelConfig, preset
from dsflash.model.params import param_specs


def same_bytes(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def cfg():
    return preset("tiny")


@pytest.fixture(scope="module")
def params(cfg):
    # random stored bytes (every FP8 code, every nibble pair): a stricter bit-identity check than a
    # random LM, and fast; the init_params path is covered in test_checkpoint_synth.py
    return random_stored_params(cfg, seed=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, cfg, params):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt"), cfg, params=params, max_shard_bytes=1 << 20)


def test_layout_matches_spec(ckpt, cfg):
    """Official names/dtypes (SPEC §13.3): experts split per expert as I8 + F8_E8M0, dense FP8 + F8_E8M0."""
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        index = json.load(f)
    wm = index["weight_map"]
    files = sorted(set(wm.values()))
    assert len(files) > 2 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    headers = {f: SafetensorsFile(os.path.join(ckpt, f)) for f in files}
    assert index["metadata"]["total_size"] == sum(t.nbytes for h in headers.values() for t in h.tensors.values())
    stored = {n: headers[f].tensors[n] for n, f in wm.items()}
    E, I, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for e in range(E):
        w1 = stored[f"layers.3.ffn.experts.{e}.w1.weight"]
        assert (w1.dtype, w1.shape) == ("I8", (I, d // 2))
        s2 = stored[f"layers.3.ffn.experts.{e}.w2.scale"]
        assert (s2.dtype, s2.shape) == ("F8_E8M0", (d, I // 32))
    assert "layers.3.ffn.experts.w1.weight" not in stored  # the stacked name is internal only
    assert f"mtp.0.ffn.experts.{cfg.dspark_n_routed_experts - 1}.w3.weight" in stored
    wq = stored["layers.0.attn.wq_a.weight"]
    assert (wq.dtype, wq.shape) == ("F8_E4M3", (cfg.q_lora_rank, d))
    assert stored["layers.0.attn.wq_a.scale"].dtype == "F8_E8M0"
    assert stored["layers.1.engram.embed.weight"].dtype == "F8_E4M3"
    assert stored["embed.weight"].dtype == "BF16" and stored["layers.0.hc_attn_fn"].dtype == "F32"
    text = {n for n in wm if not n.startswith(("vision.", "aligner.", "image_"))}
    assert text == set(official_inventory(cfg))
    with open(os.path.join(ckpt, "config.json")) as f:
        assert ModelConfig.from_hf_dict(json.load(f)) == cfg
    assert os.path.exists(os.path.join(ckpt, "tokenizer.json"))


def test_files_readable_by_reference_safetensors(ckpt):
    """The reference implementation accepts our files and sees the same bytes."""
    fn = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))[1]
    with open(os.path.join(ckpt, fn), "rb") as f:
        ref = safetensors.deserialize(f.read())
    ours = SafetensorsFile(os.path.join(ckpt, fn))
    assert {n for n, _ in ref} == set(ours.keys())
    for name, t in ref:
        assert t["dtype"] == ours.tensors[name].dtype
        assert bytes(t["data"]) == ours.get(name).tobytes()


def test_reader_reads_reference_writer(tmp_path):
    """Files written by safetensors.numpy (float8 included) read back bit-exactly with our reader."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (6, 32), dtype=np.uint8)
    t = {"f8": raw.view(ml_dtypes.float8_e4m3fn), "e8m0": raw[:, :4].copy().view(ml_dtypes.float8_e8m0fnu),
         "bf16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16), "i8": raw.view(np.int8),
         "f32": rng.standard_normal(7).astype(np.float32)}
    save_file(t, tmp_path / "a.safetensors", metadata={"k": "v"})
    st = SafetensorsFile(tmp_path / "a.safetensors")
    assert st.metadata == {"k": "v"}
    assert {n: i.dtype for n, i in st.tensors.items()} == {"f8": "F8_E4M3", "e8m0": "F8_E8M0", "bf16": "BF16",
                                                            "i8": "I8", "f32": "F32"}
    for n, a in t.items():
        got = st.get(n)
        assert got.tobytes() == a.tobytes() and got.shape == a.shape
    assert st.get("e8m0").dtype == np.uint8  # UE8M0 scales are held as their bytes
    # and our writer -> our reader, with an explicit stored dtype
    write_safetensors(tmp_path / "b.safetensors", [("s", raw, "F8_E8M0"), ("w", t["f8"])])
    st2 = SafetensorsFile(tmp_path / "b.safetensors")
    assert st2.tensors["s"].dtype == "F8_E8M0" and same_bytes(st2.get("s"), raw)
    assert same_bytes(st2.get("w"), t["f8"])


def test_load_bit_identical(ckpt, cfg, params, caplog):
    with caplog.at_level(logging.INFO, logger="dsflash.checkpoint"):
        cfg2, loaded = load_checkpoint(ckpt, progress=False)
    assert cfg2 == cfg
    assert "ignoring 5 vision tensors" in caplog.text
    assert list(loaded) == [s.name for s in param_specs(cfg)]
    for name, ref in params.items():
        assert isinstance(loaded[name], jax.Array), name
        assert same_bytes(loaded[name], ref), name
    assert loaded["layers.3.ffn.experts.w1.weight"].shape == (cfg.n_routed_experts, cfg.moe_intermediate_size,
                                                              cfg.hidden_size // 2)


def test_host_tables_modes(ckpt, cfg, params):
    _, host = load_checkpoint(ckpt, host_tables="host", progress=False)
    t = host["layers.1.engram.embed.weight"]
    assert isinstance(t, np.memmap) and not t.flags.writeable
    assert same_bytes(t, params["layers.1.engram.embed.weight"])
    assert same_bytes(host["layers.1.engram.embed.scale"], params["layers.1.engram.embed.scale"])
    assert isinstance(host["layers.1.engram.wkv.weight"], jax.Array)  # only the tables stay on the host
    _, skipped = load_checkpoint(ckpt, host_tables="skip", progress=False)
    assert "layers.1.engram.embed.weight" not in skipped and "layers.1.engram.wkv.weight" in skipped
    with pytest.raises(ValueError, match="host_tables"):
        load_checkpoint(ckpt, host_tables="disk", progress=False)


def test_load_into_shardings(ckpt, cfg, params):
    """Each tensor is assembled straight into its sharding (8 faked CPU devices)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    shard = {
        "layers.3.ffn.experts.w1.weight": NamedSharding(mesh, P("x", "y", None)),   # experts split 4 x out 2
        "layers.3.ffn.experts.w2.scale": NamedSharding(mesh, P(None, "x")),         # not along the expert axis
        "embed.weight": NamedSharding(mesh, P("x", None)),
        "layers.0.attn.wq_b.weight": NamedSharding(mesh, P(("x", "y"), None)),
        "layers.1.engram.embed.weight": NamedSharding(mesh, P("y", None)),          # 4062 rows
        "norm.weight": NamedSharding(mesh, P()),
    }
    _, loaded = load_checkpoint(ckpt, shardings=shard, progress=False)
    for name, s in shard.items():
        assert loaded[name].sharding.is_equivalent_to(s, loaded[name].ndim), name
        assert same_bytes(loaded[name], params[name]), name
    a = loaded["layers.3.ffn.experts.w1.weight"]
    assert a.addressable_shards[0].data.shape == (cfg.n_routed_experts // 4, cfg.moe_intermediate_size // 2,
                                                  cfg.hidden_size // 2)
    with pytest.raises(ValueError, match="layers.3.ffn.experts.w9.weight"):
        load_checkpoint(ckpt, shardings={"layers.3.ffn.experts.w9.weight": shard["norm.weight"]}, progress=False)


def test_single_file_checkpoint(tmp_path, cfg, params):
    """A lone model.safetensors (no index) loads too."""
    from dsflash.checkpoint.synth import official_tensors
    write_safetensors(tmp_path / "model.safetensors", list(official_tensors(cfg, params)))
    cfg.save_json(tmp_path / "config.json")
    _, loaded = load_checkpoint(tmp_path, progress=False)
    for name, ref in params.items():
        assert same_bytes(loaded[name], ref), name


def test_load_wide_ep_physical_slots(ckpt, cfg, params):
    """Wide-EP with redundant experts: stacked experts load straight into physical slots (phy2log) under
    the sharding rules of dsflash.sharding, equal to expanding the logical params."""
    from dsflash.sharding import rules
    from dsflash.checkpoint import expert_slots_from_phy2log
    from dsflash.sharding.mesh import make_mesh

    mesh = make_mesh("dep=8")
    strategy = rules.get_strategy("wide_ep", redundant_experts=8, draft_expert_parallel=False)
    shardings = rules.param_shardings(cfg, mesh, strategy)
    P_ = cfg.n_routed_experts + 8
    phy2log = np.array([(np.arange(P_) * (3 + l)) % cfg.n_routed_experts for l in range(cfg.num_hidden_layers)])
    _, loaded = load_checkpoint(ckpt, shardings=shardings, expert_slots=expert_slots_from_phy2log(phy2log),
                                progress=False)
    for l in range(cfg.num_hidden_layers):
        for t in ("w1.weight", "w1.scale", "w2.weight", "w3.scale"):
            name = f"layers.{l}.ffn.experts.{t}"
            a = loaded[name]
            assert a.shape[0] == P_ and a.sharding.is_equivalent_to(shardings[name], a.ndim)
            assert same_bytes(a, np.asarray(params[name])[phy2log[l]]), name
    assert same_bytes(loaded["mtp.0.ffn.experts.w2.weight"], params["mtp.0.ffn.experts.w2.weight"])
    with pytest.raises(ValueError, match="expert_slots"):
        load_checkpoint(ckpt, expert_slots={"layers.0.ffn.experts": [0, 99]}, progress=False)
    with pytest.raises(ValueError, match="expert_slots"):
        load_checkpoint(ckpt, expert_slots={"layers.0.attn": [0]}, progress=False)
