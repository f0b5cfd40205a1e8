"""orbax save/restore of converted params: bytes and float8 dtypes round-trip, restore into shardings."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsflash.checkpoint import load_checkpoint, restore_params, save_params
from dsflash.checkpoint.synth import random_stored_params, write_synthetic_checkpoint
from dsflash.config import preset
from dsflash.model.params import spec_map


def same_bytes(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    cfg = preset("tiny")
    folder = write_synthetic_checkpoint(tmp_path_factory.mktemp("src"), cfg, params=random_stored_params(cfg, 5),
                                        tokenizer=False)
    return load_checkpoint(folder, progress=False)


def test_roundtrip(tmp_path, loaded):
    cfg, params = loaded
    path = save_params(tmp_path / "orbax", params)
    back = restore_params(path, cfg)
    assert list(back) == list(params)
    for name, a in params.items():
        assert isinstance(back[name], jax.Array), name
        assert same_bytes(back[name], a), name
    assert back["layers.0.attn.wq_a.weight"].dtype == jnp.float8_e4m3fn
    assert back["layers.0.attn.wq_a.scale"].dtype == jnp.uint8
    with pytest.raises(Exception):          # no silent overwrite
        save_params(path, params)
    save_params(path, params, overwrite=True)


def test_sharded_and_host(tmp_path, loaded):
    cfg, params = loaded
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    sh = {"layers.3.ffn.experts.w1.weight": NamedSharding(mesh, P("x", "y")),
          "layers.0.attn.wq_b.weight": NamedSharding(mesh, P("x", None)),       # float8, sharded
          "layers.0.attn.wq_b.scale": NamedSharding(mesh, P("y", None)),
          "head.weight": NamedSharding(mesh, P(("x", "y"), None))}
    _, sharded = load_checkpoint_into(loaded, sh)
    extra = {"engram.token_map": jnp.arange(cfg.vocab_size, dtype=jnp.int32)}  # derived, outside the table
    host = {k: np.asarray(v) for k, v in sharded.items() if spec_map(cfg)[k].host}
    path = save_params(tmp_path / "o", {**sharded, **host, **extra})        # numpy + sharded jax arrays
    back = restore_params(path, cfg, sh, host_tables="host")
    for name, s in sh.items():
        assert back[name].sharding.is_equivalent_to(s, back[name].ndim), name
        assert same_bytes(back[name], params[name]), name
    t = back["layers.1.engram.embed.weight"]
    assert isinstance(t, np.ndarray) and t.dtype == jnp.float8_e4m3fn
    assert same_bytes(t, params["layers.1.engram.embed.weight"])
    assert same_bytes(back["engram.token_map"], extra["engram.token_map"])


def test_host_memmaps_save(tmp_path, loaded):
    """Params loaded with host_tables='host' (np.memmap tables) save and restore as they are."""
    cfg, params = loaded
    src = tmp_path / "src"
    write_synthetic_checkpoint(src, cfg, params=params, tokenizer=False, include_vision=False)
    _, host = load_checkpoint(src, host_tables="host", progress=False)
    assert isinstance(host["layers.1.engram.embed.scale"], np.memmap)
    back = restore_params(save_params(tmp_path / "o", host), cfg, host_tables="host")
    for name in ("layers.1.engram.embed.weight", "layers.1.engram.embed.scale", "layers.1.engram.wkv.weight"):
        assert same_bytes(back[name], params[name]), name


def test_physical_expert_slots(tmp_path, loaded):
    """Wide-EP params (stacked experts with redundant physical slots) save and restore."""
    cfg, params = loaded
    name = "layers.2.ffn.experts.w3.weight"
    phys = dict(params, **{name: jnp.concatenate([params[name], params[name][:3]])})
    back = restore_params(save_params(tmp_path / "p", phys), cfg)
    assert back[name].shape[0] == cfg.n_routed_experts + 3 and same_bytes(back[name], phys[name])


def load_checkpoint_into(loaded, shardings):
    cfg, params = loaded
    return cfg, {k: (jax.device_put(v, shardings[k]) if k in shardings else v) for k, v in params.items()}


def test_restore_errors(tmp_path, loaded):
    cfg, params = loaded
    partial = {k: v for k, v in params.items() if k != "norm.weight"}
    path = save_params(tmp_path / "partial", partial)
    with pytest.raises(ValueError, match="'norm.weight'"):
        restore_params(path, cfg)
    with pytest.raises(ValueError, match="does not exist"):
        restore_params(tmp_path / "nothing", cfg)
    other = preset("tiny").replace(moe_intermediate_size=128)
    path = save_params(tmp_path / "full", params)
    with pytest.raises(ValueError, match=r"'layers\.0\.ffn\.shared_experts\.w1\.weight'|experts"):
        restore_params(path, other)
