"""EPLB in the engine (docs/engine.md "EPLB"): per-step per-physical-expert load of valid rows only, a
rebalance that installs new per-layer tables (and moves expert weights) without recompiling or changing
greedy outputs, balancedness in the metrics / Prometheus export.

Tiny model on ``dep=2`` over two faked CPU devices (tests/conftest.py fakes 8; with fewer the test re-runs
itself in a child process), fp32, 2 redundant experts (10 physical slots, 5 per EP rank)."""

import jax
import numpy as np
import pytest

from dsflash.serve.engine import LLMEngine
from dsflash.serve.types import SamplingParams
from multi_device import TINY_ENGINE, prompts, rerun_in_child, run_all

MODEL = TINY_ENGINE


def test_bad_eplb_options_name_the_field():
    for kw, field in ((dict(eplb="yes"), "eplb"), (dict(eplb_window=0), "eplb_window"),
                      (dict(eplb_interval=-1), "eplb_interval"), (dict(eplb_redundant_experts=1.5),
                                                                  "eplb_redundant_experts")):
        with pytest.raises(ValueError, match=field):
            LLMEngine("tiny", compilation_cache=False, **kw, **MODEL)
    with pytest.raises(ValueError, match="eplb"):          # no mesh: no expert parallelism to balance
        LLMEngine("tiny", eplb=True, **MODEL)


def test_tiny_dep2_eplb_records_valid_rows_and_rebalances_without_changing_outputs():
    if rerun_in_child(__file__, "test_tiny_dep2_eplb_records_valid_rows_and_rebalances_without_changing_outputs"):
        return
    from dsflash.serve.http.metrics import ServerMetrics
    from dsflash.sharding.mesh import make_mesh
    eng = LLMEngine("tiny", mesh=make_mesh("dep=2", jax.devices()[:2]), eplb=True, speculative_mode="always", eplb_window=50,
                    eplb_interval=10_000, eplb_redundant_experts=2, **MODEL)
    ep = eng.eplb
    L, k = eng.backend.cfg.num_hidden_layers, eng.backend.cfg.num_experts_per_tok
    assert (ep.L, ep.P, ep.n_ep) == (L, 10, 2) and eng.dp == 2
    w1 = eng.runner.params["layers.0.ffn.experts.w1.weight"]
    assert w1.shape[0] == 10 and not w1.sharding.is_fully_replicated

    # (a) a prefill-only step pinned to rank 0: rank 1 contributes dummy rows (valid=False); the recorded
    #     load is exactly the prompt's tokens x top-k per layer, all from rank 0's rows
    prompt = prompts(1, seed=3, lo=20, hi=21, vocab=512)[0]
    eng.add_request("one", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), dp_rank=0)
    eng.step()
    assert not eng.has_unfinished_requests()
    load = ep.last_load
    assert load.shape == (L, 10)
    np.testing.assert_array_equal(load.sum(1), np.full(L, len(prompt) * k))
    assert eng.metrics.dp_dummy_calls[1] >= 1
    # per logical expert: at most one slot per token (top-k ids are distinct)
    logical = np.zeros((L, 8))
    for l in range(L):
        np.add.at(logical[l], ep.state.phy2log[l], load[l])
    assert logical.max() <= len(prompt)

    # (b) greedy outputs, then a forced rebalance (new tables + weight moves), then the same outputs
    ps = prompts(6, seed=5, lo=5, hi=40, vocab=512)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    items = [(f"r{i}", p, sp, None) for i, p in enumerate(ps)]
    before = run_all(eng, items)
    assert eng.metrics.spec_num_drafts > 0            # verification forwards ran (and were recorded)
    old = ep.state.phy2log.copy()
    old_tables = np.asarray(eng.runner.params["eplb.log2phy"]).copy()
    plan = eng.eplb_rebalance()
    assert not np.array_equal(old, ep.state.phy2log) and plan.num_copies > 0
    assert not np.array_equal(old_tables, np.asarray(eng.runner.params["eplb.log2phy"]))
    # replicas: the two redundant slots now hold hot experts, and every slot holds its logical expert's weights
    w = np.asarray(eng.runner.params["layers.0.ffn.experts.w1.weight"])
    w0 = np.asarray(eng.backend.model.params["layers.0.ffn.experts.w1.weight"])
    np.testing.assert_array_equal(w, w0[ep.state.phy2log[0]])
    eng.reset_prefix_cache()
    after = run_all(eng, [(f"s{i}", p, sp, None) for i, p in enumerate(ps)])
    assert [after[f"s{i}"] for i in range(6)] == [before[f"r{i}"] for i in range(6)]

    # (c) balancedness (and the rest) in the metrics and the Prometheus export
    snap = eng.metrics_snapshot()
    assert 0 < snap["eplb_balancedness"] <= 1 and snap["eplb_rebalances"] == 1
    assert snap["eplb_expert_copies"] == plan.num_copies and snap["eplb_recorded_steps"] > 2
    text = ServerMetrics(lambda: snap).render().decode()
    assert "dsflash_engine_eplb_balancedness" in text

    # (d) a periodic rebalance: due after `interval` steps, applied one layer per step
    ep.state.steps_since = ep.state.config.step_interval - 1
    rb = ep.state.metrics()["rebalances"]
    res = run_all(eng, [("t0", ps[0], sp, None)])
    assert ep.state.metrics()["rebalances"] == rb + 1
    assert res["t0"] == before["r0"]
