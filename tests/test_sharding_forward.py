"""Sharded model forward on dep=8 (params with the DEP rule table, batch/state over the DP axis, routed
experts expert-parallel through the model's ``routed_fn`` hook) == single-device forward, tiny config.

Precision "fp32": on CPU, XLA's excess-precision elimination rounds bf16 intermediates differently in
programs compiled for different shardings (even plain GSPMD without EP differs by ~0.03 in logits, and
the random tiny model's discrete top-k choices then amplify it); with fp32 the sharded and single-device
programs agree to ~1e-5.
"""
import importlib

import jax
import numpy as np
import pytest

F = importlib.import_module("dsflash.model.forward")

from dsflash.config import preset  # noqa: E402
from dsflash.model.params import init_params  # noqa: E402
from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch  # noqa: E402
from dsflash.sharding import rules  # noqa: E402
from dsflash.sharding.ep_moe import EPSettings, make_routed_fn  # noqa: E402
from dsflash.sharding.mesh import make_mesh  # noqa: E402

PREC = "fp32"
PAGE = 16
B, S = 8, 24
# cheaper CPU codegen; both sides use the same options
CO = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def run(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=CO)(*args)


def close(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= 1e-4 * scale, f"{what}: max |sharded - single| = {err:.3g} (scale {scale:.3g})"


@pytest.fixture(scope="module")
def setup():
    cfg = preset("tiny")
    params = init_params(cfg, seed=0)
    mesh = make_mesh("dep=8")
    strategy = rules.get_strategy("dep", draft_expert_parallel=False)
    sparams = jax.device_put(params, rules.param_shardings(cfg, mesh, strategy))
    pages = -(-(S + 4) // PAGE)
    geo = CacheGeometry(num_slots=B, num_pages=B * pages, page_size=PAGE)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, S)).astype(np.int32)
    lengths = np.array([24, 20, 24, 7, 24, 1, 24, 16], np.int32)
    batch = make_batch(tokens, lengths=lengths, pages_per_seq=pages)
    opts = RunOptions(logits="all", page_size=PAGE, precision=PREC)
    state = init_state(cfg, geo, PREC)
    want, want_state = run(lambda p, b, s: F.forward(p, cfg, b, s, opts), params, batch, state)
    sstate = jax.device_put(state, rules.state_shardings(state, mesh, strategy))
    sbatch = jax.device_put(batch, rules.batch_shardings(batch, mesh, strategy))
    fn = make_routed_fn(mesh, EPSettings("allgather", "prefill"))
    got, got_state = run(lambda p, b, s: F.forward(p, cfg, b, s, opts, routed_fn=fn), sparams, sbatch, sstate)
    return dict(cfg=cfg, params=params, sparams=sparams, mesh=mesh, strategy=strategy, batch=batch, pages=pages,
                lengths=lengths, want=want, want_state=want_state, got=got, got_state=got_state)


def test_sharded_prefill_matches_single_device(setup):
    want, got = setup["want"]["logits"], setup["got"]["logits"]
    valid = np.arange(S)[None] < setup["lengths"][:, None]
    assert np.isfinite(np.asarray(want)[valid]).all() and float(np.asarray(want).std()) > 0
    close(np.asarray(got)[valid], np.asarray(want)[valid], "prefill logits")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(setup["want_state"]),
                            jax.tree.leaves(setup["got_state"])):
        close(b, a, "state" + jax.tree_util.keystr(path))


def test_sharded_decode_matches_single_device(setup):
    cfg, lengths = setup["cfg"], setup["lengths"]
    last = np.asarray(setup["want"]["logits"])[np.arange(B), np.maximum(lengths - 1, 0)]
    nxt = last.argmax(-1).astype(np.int32)[:, None]
    dec_len = np.ones(B, np.int32)
    dec_len[3] = 0                                         # an idle row (dummy) in the decode step
    batch = make_batch(nxt, start=lengths, lengths=dec_len, pages_per_seq=setup["pages"])
    opts = RunOptions(logits="last", page_size=PAGE, precision=PREC)
    want, _ = run(lambda p, b, s: F.forward(p, cfg, b, s, opts), setup["params"], batch, setup["want_state"])
    mesh, strategy = setup["mesh"], setup["strategy"]
    sbatch = jax.device_put(batch, rules.batch_shardings(batch, mesh, strategy))
    # decode: fixed capacity per destination rank (1 token x top-2 per rank), static shapes
    fn = make_routed_fn(mesh, EPSettings("all_to_all", "decode", capacity=2))
    got, _ = run(lambda p, b, s: F.forward(p, cfg, b, s, opts, routed_fn=fn), setup["sparams"], sbatch,
                 setup["got_state"])
    rows = dec_len > 0
    close(np.asarray(got["logits"])[rows], np.asarray(want["logits"])[rows], "decode logits")
