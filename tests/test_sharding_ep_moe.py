"""Expert-parallel routed MoE on 8 faked CPU devices == single-device routed_moe."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.config import preset
from dsflash.kernels.moe_gemm import routed_moe
from dsflash import quant
from dsflash.sharding.ep_moe import EPSettings, ep_routed_moe
from dsflash.sharding.mesh import make_mesh

LIMIT = 10.0


def make_experts(key, E, d, I):
    k1, k2, k3 = jax.random.split(key, 3)
    w1, s1 = quant.quantize_mxfp4_weight(jax.random.normal(k1, (E, I, d)) / np.sqrt(d))
    w3, s3 = quant.quantize_mxfp4_weight(jax.random.normal(k2, (E, I, d)) / np.sqrt(d))
    w2, s2 = quant.quantize_mxfp4_weight(jax.random.normal(k3, (E, d, I)) / np.sqrt(I))
    return w1, s1, w3, s3, w2, s2


def make_routing(key, T, d, E, k, skew=0.0):
    kx, ki, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (T, d), jnp.float32).astype(jnp.bfloat16)
    logits = jax.random.normal(ki, (T, E)) - skew * jnp.arange(E) / E
    _, idx = jax.lax.top_k(logits, k)
    weight = jax.nn.softmax(jax.random.normal(kw, (T, k)), axis=-1).astype(jnp.float32)
    return x, idx.astype(jnp.int32), weight


def reference(x, idx, weight, experts, valid=None, precision="reference"):
    if valid is not None:
        weight = jnp.where(valid[:, None], weight, 0.0)
    return jax.jit(lambda *a: routed_moe(*a, limit=LIMIT, precision=precision))(x, idx, weight, *experts)


def run_ep(mesh, settings, x, idx, weight, experts, valid=None, precision="reference"):
    f = jax.jit(lambda *a: ep_routed_moe(*a[:-1], mesh=mesh, limit=LIMIT, precision=precision,
                                         settings=settings, valid=a[-1], return_stats=True))
    v = jnp.ones((x.shape[0],), bool) if valid is None else valid
    return f(x, idx, weight, *experts, v)


def _close(a, b, k):
    a, b = np.asarray(a), np.asarray(b)
    if k <= 2:
        np.testing.assert_array_equal(a, b)   # two partial sums: order-independent, bit exact
    else:
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max())


CASES = [
    ("dep=8", EPSettings("allgather", "prefill")),
    ("dep=8", EPSettings("allgather", "decode", capacity=32)),
    ("dep=8", EPSettings("all_to_all", "prefill")),
    ("dep=8", EPSettings("all_to_all", "decode", capacity=16)),
    ("dep=4,tp=2", EPSettings("allgather", "prefill")),
    ("dep=4,tp=2", EPSettings("allgather", "decode", capacity=32)),
]


@pytest.mark.parametrize("spec,settings", CASES, ids=[f"{s}-{e.collective}-{e.mode}" for s, e in CASES])
def test_ep_matches_single_device_tiny(spec, settings):
    cfg = preset("tiny")
    E, d, I, k, T = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, 32
    experts = make_experts(jax.random.PRNGKey(0), E, d, I)
    x, idx, weight = make_routing(jax.random.PRNGKey(1), T, d, E, k)
    mesh = make_mesh(spec)
    want = reference(x, idx, weight, experts)
    got, stats = run_ep(mesh, settings, x, idx, weight, experts)
    assert int(stats["dropped"]) == 0
    _close(got, want, k)


@pytest.mark.parametrize("collective", ["allgather", "all_to_all"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_ep_matches_single_device_wide(collective, mode):
    """Wider: 32 experts (4 per device), top-6, skewed routing, padding rows masked."""
    E, d, I, k, T = 32, 256, 64, 6, 32
    experts = make_experts(jax.random.PRNGKey(2), E, d, I)
    x, idx, weight = make_routing(jax.random.PRNGKey(3), T, d, E, k, skew=3.0)
    valid = jnp.arange(T) < T - 5
    mesh = make_mesh("dep=8")
    settings = EPSettings(collective, mode, capacity=(None if mode == "prefill" else T * k // 8 * 2))
    want = reference(x, idx, weight, experts, valid)
    got, stats = run_ep(mesh, settings, x, idx, weight, experts, valid)
    assert int(stats["dropped"]) == 0
    _close(got, want, k)
    assert np.all(np.asarray(got)[T - 5:] == 0)


def test_decode_capacity_drops_are_counted():
    E, d, I, k, T = 8, 256, 64, 2, 64
    experts = make_experts(jax.random.PRNGKey(0), E, d, I)
    x, _, weight = make_routing(jax.random.PRNGKey(1), T, d, E, k)
    idx = jnp.stack([jnp.zeros(T, jnp.int32), jnp.ones(T, jnp.int32)], 1)  # everything on experts 0/1
    mesh = make_mesh("dep=8")
    _, stats = run_ep(mesh, EPSettings("allgather", "decode", capacity=16), x, idx, weight, experts)
    assert int(stats["dropped"]) == 2 * (T - 16)
    got, stats = run_ep(mesh, EPSettings("allgather", "decode", capacity=T), x, idx, weight, experts)
    assert int(stats["dropped"]) == 0
    _close(got, reference(x, idx, weight, experts), k)


def test_settings_validation():
    with pytest.raises(ValueError, match="collective"):
        EPSettings(collective="ragged")
    with pytest.raises(ValueError, match="mode"):
        EPSettings(mode="x")
    cfg = preset("tiny")
    experts = make_experts(jax.random.PRNGKey(0), 8, cfg.hidden_size, cfg.moe_intermediate_size)
    x, idx, weight = make_routing(jax.random.PRNGKey(1), 12, cfg.hidden_size, 8, 2)
    with pytest.raises(ValueError, match="do not divide"):
        ep_routed_moe(x, idx, weight, *experts, mesh=make_mesh("dep=8"), limit=LIMIT)
    with pytest.raises(ValueError, match="all_to_all"):
        x, idx, weight = make_routing(jax.random.PRNGKey(1), 16, cfg.hidden_size, 8, 2)
        ep_routed_moe(x, idx, weight, *experts, mesh=make_mesh("dep=4,tp=2"), limit=LIMIT,
                      settings=EPSettings("all_to_all"))


def test_wide_ep_with_eplb_replicas_matches_logical():
    """wide-EP: 8 logical + 8 redundant experts over dep=8 (2 physical per device), EPLB-routed."""
    from dsflash.sharding import eplb
    E, R, d, I, k, T = 8, 8, 256, 64, 2, 32
    experts = make_experts(jax.random.PRNGKey(4), E, d, I)
    x, idx, weight = make_routing(jax.random.PRNGKey(5), T, d, E, k, skew=4.0)
    want = reference(x, idx, weight, experts)
    load = np.bincount(np.asarray(idx).reshape(-1), minlength=E)[None]
    phy2log, log2phy, cnt = eplb.rebalance_experts(load, E + R, 1, 1, 8)
    phys_experts = tuple(jnp.take(w, jnp.asarray(phy2log[0]), axis=0) for w in experts)
    pid, _ = eplb.route(idx, jnp.asarray(log2phy[0]), jnp.asarray(cnt[0]), num_physical=E + R)
    got, stats = run_ep(make_mesh("dep=8"), EPSettings("all_to_all", "prefill"), x, pid, weight, phys_experts)
    _close(got, want, k)
