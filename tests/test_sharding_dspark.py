"""DSpark draft (update_context + propose) sharded on dep=8 == single device, tiny config.

The draft's 4 routed experts run wide-EP: 4 redundant replicas make 8 physical slots, one per device,
placed by the EPLB policy from a skewed load; logical ids are mapped to replicas by the EPLB router and
the MoE runs through ``ep_routed_moe`` passed as ``propose``'s ``routed_fn`` hook."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsflash.model import dspark  # noqa: E402

from dsflash.config import preset  # noqa: E402
from dsflash.model.params import init_params  # noqa: E402
from dsflash.model.state import CacheGeometry, RunOptions, init_state  # noqa: E402
from dsflash.sharding import eplb, rules  # noqa: E402
from dsflash.sharding.ep_moe import EPSettings, make_routed_fn  # noqa: E402
from dsflash.sharding.mesh import make_mesh  # noqa: E402

PREC = "fp32"
B, S = 8, 20
CO = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def run(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=CO)(*args)


def test_sharded_dspark_matches_single_device():
    cfg = preset("tiny")
    assert cfg.n_stages == 1  # one draft MoE layer: one EPLB table serves the routed_fn hook
    params = init_params(cfg, seed=1)
    opts = RunOptions(page_size=16, precision=PREC)
    geo = CacheGeometry(num_slots=B, num_pages=B, page_size=16)
    T = len(cfg.dspark_target_layer_ids)
    taps = jax.random.normal(jax.random.PRNGKey(0), (B, S, T * cfg.hidden_size), jnp.float32)
    start = jnp.zeros((B,), jnp.int32)
    lengths = jnp.array([20, 12, 20, 5, 20, 9, 20, 16], jnp.int32)
    slots = jnp.arange(B, dtype=jnp.int32)
    y = jnp.arange(B, dtype=jnp.int32) * 37 % cfg.vocab_size
    pos = lengths

    def draft(p, st, taps, y, pos, slots, routed_fn=None):
        st = dspark.update_context(p, cfg, taps, start, lengths, slots, st, opts)
        return dspark.propose(p, cfg, st, y, pos, slots, opts, routed_fn=routed_fn)

    want = run(draft, params, init_state(cfg, geo, PREC), taps, y, pos, slots)

    # wide-EP placement of the draft experts: 4 logical + 4 redundant over dep=8
    mesh = make_mesh("dep=8")
    strategy = rules.get_strategy("wide_ep", draft_redundant_experts=4)
    phy2log, log2phy, logcnt = eplb.rebalance_experts(np.array([[40, 20, 10, 5]]), 8, 1, 1, 8)
    assert sorted(logcnt[0].tolist()) == [1, 1, 2, 4]
    phys = eplb.expand_to_physical(params, phy2log, cfg.n_stages, draft=True)
    sparams = jax.device_put(phys, rules.param_shardings(cfg, mesh, strategy))
    assert sparams["mtp.0.ffn.experts.w1.weight"].sharding.spec == jax.sharding.PartitionSpec("dep")
    state = init_state(cfg, geo, PREC)
    sstate = jax.device_put(state, rules.state_shardings(state, mesh, strategy))
    dp = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dep"))
    staps, sy, spos, sslots = (jax.device_put(a, dp) for a in (taps, y, pos, slots))

    routed = make_routed_fn(mesh, EPSettings("allgather", "decode", capacity=B * cfg.dspark_block_size),
                            log2phy=log2phy[0], logcnt=logcnt[0])
    calls = []

    def routed_spy(*a, **kw):
        calls.append(kw.get("layer"))
        return routed(*a, **kw)

    got = run(functools.partial(draft, routed_fn=routed_spy), sparams, sstate, staps, sy, spos, sslots)
    assert calls == ["mtp.0"]                              # the draft block ran the EP MoE

    np.testing.assert_array_equal(np.asarray(got["drafts"]), np.asarray(want["drafts"]))
    for k in ("logits", "confidence"):
        w, g = np.asarray(want[k]), np.asarray(got[k])
        assert np.abs(g - w).max() <= 1e-4 * max(1.0, np.abs(w).max()), k
