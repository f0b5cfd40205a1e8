"""dsflash.load(mesh="dep=8"): params, state and batches placed by the DEP rule table, routed experts run
expert-parallel; logits equal the single-device model (fp32) for prefill and decode."""
import jax
import numpy as np

import dsflash


def test_load_with_dep8_mesh_matches_single_device():
    assert jax.device_count() >= 8                          # tests/conftest.py fakes 8 CPU devices
    toks = np.random.default_rng(3).integers(0, 512, (3, 24))
    single = dsflash.load("tiny", seed=4, precision="fp32", page_size=16)
    # tiny's draft has 4 experts: it cannot split 8 ways, so the draft keeps its experts whole
    from dsflash.sharding.rules import get_strategy
    with __import__("pytest").raises(ValueError, match="mtp.0.ffn.experts"):
        dsflash.load("tiny", seed=4, precision="fp32", page_size=16, mesh="dep=8")
    strategy = get_strategy("dep", draft_expert_parallel=False)
    sharded = dsflash.load("tiny", seed=4, precision="fp32", page_size=16, mesh="dep=8", strategy=strategy)
    w = sharded.params["layers.2.ffn.experts.w1.weight"]
    assert len(w.sharding.device_set) == 8
    np.testing.assert_allclose(sharded.logits(toks), single.logits(toks), atol=2e-4)

    s1, s8 = single.init_state(3, 32), sharded.init_state(3, 32)
    for sess, m in ((s1, single), (s8, sharded)):
        m.forward(toks, sess)
    a = single.forward(toks[:, :1], s1, start=24)["logits"]
    b = sharded.forward(toks[:, :1], s8, start=24)["logits"]
    assert b.shape == (3, 512)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-4)
