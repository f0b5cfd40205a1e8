"""Wide mesh: the tiny model's forward on dep=32 (wide-EP: 8 experts + 24 redundant replicas, EPLB-routed,
all_to_all dispatch) == single device. Runs in a child process with 32 faked CPU devices (the test
session has 8)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

N = 32


def child():
    import importlib

    import jax
    F = importlib.import_module("dsflash.model.forward")
    from dsflash.config import preset
    from dsflash.model.params import init_params
    from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch
    from dsflash.sharding import eplb, rules
    from dsflash.sharding.ep_moe import EPSettings, make_routed_fn
    from dsflash.sharding.mesh import make_mesh

    co = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

    def run(fn, *args):
        return jax.jit(fn).lower(*args).compile(compiler_options=co)(*args)

    cfg = preset("tiny")
    B, S, PAGE = N, 8, 16
    params = init_params(cfg, seed=0)
    geo = CacheGeometry(num_slots=B, num_pages=B, page_size=PAGE)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, S)).astype(np.int32)
    lengths = rng.integers(0, S + 1, B).astype(np.int32)
    batch = make_batch(tokens, lengths=lengths, pages_per_seq=1)
    opts = RunOptions(logits="all", page_size=PAGE, precision="fp32")
    want, _ = run(lambda p, b, s: F.forward(p, cfg, b, s, opts), params, batch, init_state(cfg, geo, "fp32"))

    mesh = make_mesh(f"dep={N}")
    R = N - cfg.n_routed_experts
    strategy = rules.get_strategy("wide_ep", redundant_experts=R, draft_redundant_experts=N - cfg.dspark_n_routed_experts)
    # one layout for every layer (the routed_fn hook has no layer index): vLLM's start layout p -> p mod E
    phy2log = eplb.initial_phy2log(cfg.num_hidden_layers, cfg.n_routed_experts, N)
    log2phy, logcnt = eplb.tables_from_phy2log(phy2log, cfg.n_routed_experts)
    phys = eplb.expand_to_physical(params, phy2log, cfg.num_hidden_layers)
    phys = eplb.expand_to_physical(phys, eplb.initial_phy2log(cfg.n_stages, cfg.dspark_n_routed_experts, N),
                                   cfg.n_stages, draft=True)
    sparams = jax.device_put(phys, rules.param_shardings(cfg, mesh, strategy))
    state = init_state(cfg, geo, "fp32")
    sstate = jax.device_put(state, rules.state_shardings(state, mesh, strategy))
    sbatch = jax.device_put(batch, rules.batch_shardings(batch, mesh, strategy))
    fn = make_routed_fn(mesh, EPSettings("all_to_all", "prefill"), log2phy=log2phy[0], logcnt=logcnt[0])
    got, _ = run(lambda p, b, s: F.forward(p, cfg, b, s, opts, routed_fn=fn), sparams, sbatch, sstate)
    w, g = np.asarray(want["logits"]), np.asarray(got["logits"])
    valid = np.arange(S)[None] < lengths[:, None]
    print(json.dumps({"err": float(np.abs(g - w)[valid].max()), "scale": float(np.abs(w[valid]).max()),
                      "experts_per_device": int(sparams["layers.0.ffn.experts.w1.weight"]
                                                .addressable_shards[0].data.shape[0])}))


def test_forward_dep32_wide_ep_matches_single_device():
    pytest.importorskip("dsflash.model.forward", reason="dsflash.model.forward not available yet")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={N}", JAX_PLATFORMS="cpu",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env, capture_output=True,
                       text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["experts_per_device"] == 1
    assert res["err"] <= 1e-4 * max(1.0, res["scale"]), res


if __name__ == "__main__" and "--child" in sys.argv:
    child()
