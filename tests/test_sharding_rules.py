"""Meshes from specs, rule tables, validation (collisions, quantisation blocks), state/batch shardings, and
golden sharding snapshots (tests/golden/sharding_*.json; regenerate with DSFLASH_UPDATE_GOLDEN=1)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dsflash.config import preset
from dsflash.model.params import abstract_params, param_specs
from dsflash.model.state import CacheGeometry, init_state, make_batch
from dsflash.sharding import rules
from dsflash.sharding.mesh import abstract_mesh, make_mesh, mesh_spec, parse_spec
from dsflash.sharding.rules import (Strategy, get_strategy, param_partition_specs, param_shardings,
                                    state_partition_specs)


# ------------------------------------------------------------------ meshes
def test_parse_and_make_mesh():
    assert parse_spec("dep=8") == {"dep": 8}
    assert list(parse_spec("tp=2,dep=4")) == ["dep", "tp"]           # canonical order, tp innermost
    assert parse_spec("dep=*,tp=2", 8) == {"dep": 4, "tp": 2}
    m = make_mesh("dep=8")
    assert m.axis_names == ("dep",) and m.devices.size == 8
    m = make_mesh("dep=4,tp=2")
    assert dict(zip(m.axis_names, m.devices.shape)) == {"dep": 4, "tp": 2}
    assert make_mesh("dep=2", jax.devices()[:2]).devices.size == 2
    assert mesh_spec(abstract_mesh("dep=32")) == "dep=32"
    assert mesh_spec(make_mesh("tp=-1")) == "tp=8"


@pytest.mark.parametrize("spec,msg", [("dep=4", "needs 4 devices but 8"), ("dep=32", "'dep=32' needs 32"),
                                      ("xp=8", "unknown axis 'xp'"), ("dep8", "not 'axis=size'"),
                                      ("dep=8,dep=1", "given twice"), ("dep=0", ">= 1")])
def test_mesh_errors_name_the_spec(spec, msg):
    with pytest.raises(ValueError, match=msg):
        make_mesh(spec)


# ------------------------------------------------------------------ rules
def test_param_shardings_dep8_tiny_place_params():
    cfg = preset("tiny")
    mesh = make_mesh("dep=8")
    st = get_strategy("dep", draft_expert_parallel=False)
    sh = param_shardings(cfg, mesh, st)
    assert set(sh) == {s.name for s in param_specs(cfg)}
    assert all(isinstance(v, NamedSharding) for v in sh.values())
    assert sh["layers.3.ffn.experts.w1.weight"].spec == P("dep")
    assert sh["layers.3.ffn.experts.w2.scale"].spec == P("dep")
    assert sh["mtp.0.ffn.experts.w1.weight"].spec == P()              # draft MoE data-parallel here
    assert sh["layers.3.attn.wq_b.weight"].spec == P()                 # dense weights replicated under DEP
    name = "layers.3.ffn.experts.w1.weight"
    a = jax.device_put(jnp.zeros(abstract_params(cfg)[name].shape, jnp.int8), sh[name])
    assert a.addressable_shards[0].data.shape[0] == 1                 # one expert per device


def test_init_params_placed_streams_the_same_values_onto_their_shardings():
    """``init_params_placed`` (how ``load`` and ``bench forward`` build random weights, one tensor at a time) gives
    ``init_params``'s exact values on each tensor's sharding; host Engram tables come back as numpy."""
    from dsflash.model.params import init_params, init_params_placed
    cfg = preset("tiny")
    mesh = make_mesh("dep=8")
    st = get_strategy("dep", draft_expert_parallel=False)
    ref = init_params(cfg, seed=3, as_numpy=True)
    sh = param_shardings(cfg, mesh, st, include_host=False)
    params, tables = init_params_placed(cfg, seed=3, shardings=sh, host_tables=True)
    host = {k for k in ref if ".engram.embed." in k}
    assert host and set(params) == set(ref) - host and set(sh) == set(params)
    for k, v in params.items():
        assert v.sharding == sh[k], k
        assert np.array_equal(np.asarray(v).view(np.uint8), ref[k].view(np.uint8)), k
    assert sorted(tables) == sorted(cfg.engram_layer_ids)
    for layer, (w, sc) in tables.items():
        assert isinstance(w, np.ndarray) and np.array_equal(w.view(np.uint8),
                                                            ref[f"layers.{layer}.engram.embed.weight"].view(np.uint8))
        assert np.array_equal(sc, ref[f"layers.{layer}.engram.embed.scale"])


def test_init_params_on_device_has_the_formats_and_placement_of_init_params():
    """``init_params_placed(on_device=True)`` (bench forward ``--init device``, full-size model): same names, shapes,
    dtypes, scales and shardings as ``init_params_placed``; other random values, every E4M3 code finite; the host
    tables repeat one random block."""
    import ml_dtypes

    from dsflash.model.params import init_params_placed
    cfg = preset("tiny")
    sh = param_shardings(cfg, make_mesh("dep=8"), get_strategy("dep", draft_expert_parallel=False),
                         include_host=False)
    ref, ref_tables = init_params_placed(cfg, seed=1, shardings=sh, host_tables=True)
    dev, tables = init_params_placed(cfg, seed=1, shardings=sh, host_tables=True, on_device=True)
    assert dev.keys() == ref.keys()
    for k, v in dev.items():
        r = ref[k]
        assert (v.shape, v.dtype, v.sharding) == (r.shape, r.dtype, r.sharding), k
        if k.endswith(".scale"):
            assert np.array_equal(np.asarray(v), np.asarray(r)), k
        if v.dtype == jnp.float8_e4m3fn:
            assert np.isfinite(np.asarray(v).astype(np.float32)).all(), k
    w = "layers.3.ffn.experts.w1.weight"
    assert not np.array_equal(np.asarray(dev[w]), np.asarray(ref[w]))
    for layer, (tw, ts) in tables.items():
        rw, rs = ref_tables[layer]
        assert tw.shape == rw.shape and tw.dtype == rw.dtype and np.array_equal(ts, rs)
        assert np.isfinite(tw.astype(np.float32)).all() and tw.dtype == ml_dtypes.float8_e4m3fn


def test_tp_and_dep_tp_rules():
    cfg = preset("tiny")
    tp = param_partition_specs(cfg, "tp=2", "tp")
    assert tp["layers.0.attn.wq_b.weight"] == P("tp")
    assert tp["embed.weight"] == P("tp")
    assert tp["layers.0.ffn.experts.w2.weight"] == P(None, None, "tp")
    assert tp["layers.0.ffn.shared_experts.w2.weight"] == P(None, "tp")
    dt = param_partition_specs(cfg, "dep=4,tp=2", get_strategy("dep", draft_expert_parallel=False))
    assert dt["layers.0.ffn.experts.w1.weight"] == P(("dep", "tp"))   # EP group = dep x tp
    assert dt["layers.0.attn.wq_b.weight"] == P("tp")


def test_quant_block_validation_names_the_tensor():
    cfg = preset("tiny")
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.shared_experts\.w1\.weight.*FP8 32x32"):
        param_partition_specs(cfg, "tp=4", "tp")                      # 64 rows / 4 = 16: splits 32-row blocks
    no_mlp = Strategy("tp_no_mlp", tuple((k, None if k == "mlp" else v) for k, v in rules.TP_RULES))
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.w2\.weight.*MXFP4 32-element"):
        param_partition_specs(cfg, "tp=4", no_mlp)                    # I/2 = 32 bytes / 4 = 8 bytes
    ql = Strategy("ql", tuple((k, ("tp",) if k == "q_lora" else v) for k, v in rules.DEP_RULES))
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.weight.*FP8 32x32"):
        param_partition_specs(cfg, "tp=4", ql.replace(draft_expert_parallel=False))   # q_lora 64 / 4


def test_colliding_mesh_axes_rejected():
    cfg = preset("tiny")
    bad = Strategy("bad", tuple((k, ("dep",) if k == "moe_mlp" else v) for k, v in rules.DEP_RULES))
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.w1\.weight: mesh axis 'dep'.*colliding"):
        param_partition_specs(cfg, "dep=2", bad)
    with pytest.raises(ValueError, match="uses a mesh axis twice"):
        Strategy("x", (("expert", ("dep", "dep")),))
    with pytest.raises(ValueError, match="unknown mesh axis"):
        Strategy("x", (("expert", ("gpu",)),))
    with pytest.raises(ValueError, match="no rule for logical axis 'vocab'"):
        param_partition_specs(cfg, "dep=2", Strategy("x", (("expert", ("dep",)),)))


def test_expert_divisibility_and_redundancy():
    tiny, big = preset("tiny"), preset("v41_flash")
    with pytest.raises(ValueError, match=r"mtp\.0\.ffn\.experts\.w1\.weight.*does not divide.*redundant"):
        param_partition_specs(tiny, "dep=8", "dep")                   # 4 draft experts over 8 devices
    ok = param_partition_specs(tiny, "dep=8", get_strategy("wide_ep", redundant_experts=8, draft_redundant_experts=4))
    assert ok["mtp.0.ffn.experts.w1.weight"] == P("dep")
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.w1\.weight.*384"):
        param_partition_specs(big, "dep=72", "wide_ep")
    param_partition_specs(big, "dep=72", get_strategy("wide_ep", redundant_experts=48, draft_redundant_experts=16))


def test_state_and_batch_shardings():
    cfg = preset("tiny")
    mesh = make_mesh("dep=8")
    state = jax.eval_shape(lambda: init_state(cfg, CacheGeometry(num_slots=16, num_pages=32, page_size=16)))
    specs = state_partition_specs(state, mesh)
    flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert all(s == P("dep") for s in flat)
    real = init_state(cfg, CacheGeometry(num_slots=16, num_pages=32, page_size=16))
    placed = jax.device_put(real, rules.state_shardings(real, mesh))
    leaf = placed["main_kv"]["2"]["q"]
    assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // 8
    bad = jax.eval_shape(lambda: init_state(cfg, CacheGeometry(num_slots=6, num_pages=32, page_size=16)))
    with pytest.raises(ValueError, match=r"state\[.*slots.*does not divide"):
        state_partition_specs(bad, mesh)
    batch = make_batch(np.zeros((8, 4), np.int32), pages_per_seq=2)
    bs = rules.batch_shardings(batch, mesh)
    assert bs.tokens.spec == P("dep") and bs.page_table.spec == P("dep")
    with pytest.raises(ValueError, match=r"batch.*tokens"):
        rules.batch_partition_specs(make_batch(np.zeros((6, 4), np.int32), pages_per_seq=2), mesh)


# ------------------------------------------------------------------ golden snapshots
GOLDEN = [
    ("tiny", "dep=8", get_strategy("dep", draft_expert_parallel=False)),
    ("tiny", "dep=8", get_strategy("wide_ep", redundant_experts=8, draft_redundant_experts=4)),
    ("tiny", "dep=4,tp=2", get_strategy("dep", draft_expert_parallel=False)),
    ("tiny", "tp=2", get_strategy("tp")),
    ("v41_flash", "dep=2", get_strategy("dep")),
    ("v41_flash", "dep=8", get_strategy("dep")),
    ("v41_flash", "dep=32", get_strategy("wide_ep", redundant_experts=32)),
    ("v41_flash", "dep=72", get_strategy("wide_ep", redundant_experts=48, draft_redundant_experts=16)),
    ("v41_flash", "tp=4", get_strategy("tp")),
]


@pytest.mark.parametrize("config,spec,strategy", GOLDEN, ids=[f"{c}-{m}-{s.describe()}" for c, m, s in GOLDEN])
def test_golden_sharding_snapshot(config, spec, strategy):
    ok, msg = rules.check_golden(preset(config), config, spec, strategy)
    assert ok, msg


def test_golden_detects_a_change(tmp_path, monkeypatch):
    monkeypatch.setattr(rules, "GOLDEN_DIR", str(tmp_path))
    cfg = preset("tiny")
    st = get_strategy("dep", draft_expert_parallel=False)
    assert rules.check_golden(cfg, "tiny", "dep=8", st)[1].startswith("wrote")
    assert rules.check_golden(cfg, "tiny", "dep=8", st) == (True, "match")
    changed = Strategy("dep", tuple((k, ("dep",) if k == "vocab" else v) for k, v in rules.DEP_RULES),
                       draft_expert_parallel=False)
    ok, msg = rules.check_golden(cfg, "tiny", "dep=8", changed)
    assert not ok and "embed.weight" in msg and "DSFLASH_UPDATE_GOLDEN" in msg
