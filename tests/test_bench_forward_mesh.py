"""``bench forward`` on dep=2 (faked CPU devices): EP MoE through the routed_fn hook, real vs uniform routing
balancedness over the mesh's 2 EP ranks, and the lag replay (rank 1 starts late by a calibrated on-device spin)."""
import json

import numpy as np

from dsflash.bench.__main__ import main as bench_main
from test_bench_forward import tiny4


def test_mesh_uniform_and_lag(tmp_path):
    _, cfgp = tiny4(tmp_path)
    out = tmp_path / "res"
    rc = bench_main(["forward", "--preset", cfgp, "--mesh", "dep=2", "--decode", "2@32", "--reps", "2", "--warmup",
                     "1", "--no-breakdown", "--lag", "0.005", "--no-draft", "--fast-compile", "--out", str(out),
                     "--no-plot"])
    assert rc == 0
    r = json.loads(next(out.glob("forward_*.json")).read_text())
    assert (r["mesh"], r["dp_ranks"], r["ep_ranks"]) == ("dep=2", 2, 2) and r["ep"]["collective"] == "allgather"
    (pt,) = r["points"]
    assert pt["rows"] == 4 and pt["rows_per_rank"] == 2 and pt["finite_logits"]
    bal = pt["balancedness"]
    assert bal["ranks"] == 2 and 0.5 <= bal["real"] <= 1 and 0.5 <= bal["uniform"] <= 1
    assert pt["uniform_ms"]["median"] > 0 and pt["real_over_uniform"] > 0
    lag = pt["lag"]
    assert lag["lag_s"] == 0.005 and lag["spin_iters_per_rank"] > 0 and lag["stagger_ms"] == 5.0
    assert lag["step_lag_ms"]["median"] > 0 and lag["spin_only_ms"] > 0
    assert abs(lag["exposed_ms"] + lag["absorbed_ms"] - lag["stagger_ms"]) < 1e-9


def test_mesh_with_engram_tables_in_host_memory(tmp_path):
    """``--engram-tables host --init device --zipf --eplb`` (what the full-size run needs): the tables stay numpy on
    the host, each step gathers its rows by a host callback under the dep=2 program, the weights are generated on
    the devices, the logits stay finite, the skewed-router variant is timed with its balancedness, and again with
    EPLB's physical placement (tables as jit arguments)."""
    _, cfgp = tiny4(tmp_path)
    out = tmp_path / "res"
    rc = bench_main(["forward", "--preset", cfgp, "--mesh", "dep=2", "--decode", "2@32", "--reps", "1", "--warmup",
                     "1", "--no-breakdown", "--no-uniform", "--zipf", "1.5", "--eplb", "2", "--no-draft",
                     "--engram-tables", "host", "--init", "device",
                     "--fast-compile",
                     "--out", str(out), "--no-plot"])
    assert rc == 0
    r = json.loads(next(out.glob("forward_*.json")).read_text())
    assert r["engram_tables"]["where"] == "host" and r["engram_tables"]["host_bytes"] > 0
    assert r["weights_init"] == "device"
    (pt,) = r["points"]
    assert pt["finite_logits"] and pt["step_ms"]["median"] > 0
    assert pt["zipf_alpha"] == 1.5 and pt["zipf_ms"]["median"] > 0 and 0.5 <= pt["balancedness"]["zipf"] < 1
    # EPLB on (2 redundant slots, placement from the Zipf step's loads), timed with the same router
    ep = pt["eplb"]
    assert ep["redundant"] == 2 and ep["router"] == "zipf" and ep["finite_logits"] and ep["step_ms"]["median"] > 0
    assert ep["balancedness_before"] == pt["balancedness"]["zipf"]
    assert ep["balancedness_after_predicted"] > ep["balancedness_before"]
    # per-device bytes: the routed experts (target and DSpark draft) are split over the 2 EP ranks, the host
    # tables are on no device
    from dsflash.bench.forward import load_config
    from dsflash.model.params import param_specs
    specs = [s for s in param_specs(load_config(cfgp)) if not s.host]
    total = sum(s.numel * np.dtype(s.dtype).itemsize for s in specs)
    experts = sum(s.numel * np.dtype(s.dtype).itemsize for s in specs if ".ffn.experts." in s.name)
    mem = pt["memory_per_device_bytes"]
    assert mem["params"] == total - experts // 2 and mem["state"] > 0
    # the whole-step floor of one device: its rank's rows, the dense weights, its EP rank's hit experts
    roof = pt["roofline"]
    tgt_dense = sum(s.numel * np.dtype(s.dtype).itemsize for s in specs
                    if ".ffn.experts." not in s.name and not s.name.startswith("mtp."))
    tgt_experts = sum(s.numel * np.dtype(s.dtype).itemsize for s in specs
                      if ".ffn.experts." in s.name and not s.name.startswith("mtp."))
    assert roof["notes"]["ep_ranks"] == 2 and roof["notes"]["rows"] == 2
    assert 0 < roof["ops"]["routed_experts"]["weight_bytes"] <= tgt_experts // 2
    assert roof["ops"]["embed"]["weight_bytes"] == 0                  # never the embedding table
    assert roof["bytes"] == sum(o["bytes"] for o in roof["ops"].values()) == roof["total"]["bytes"]
    assert roof["rates"]["read_Bps"] > 0
    assert abs(roof["frac_of_roofline"] - roof["roofline_ms"] / pt["step_ms"]["median"]) < 1e-9
    # the earlier accounting, kept for comparisons: all dense weights incl. the embedding + touched experts + state
    old = roof["old_definition"]
    assert old["dense_bytes_incl_embedding"] == tgt_dense and old["state_bytes"] == mem["state"]
    assert 0 < old["expert_bytes_touched"] <= tgt_experts // 2
    assert old["bytes"] == old["dense_bytes_incl_embedding"] + old["expert_bytes_touched"] + old["state_bytes"]


def test_random_router_skew_follows_the_ranking():
    """``--zipf A``'s router: distinct ids per token; at A=1.5 the experts' counts fall with their fixed rank, at
    A=0 they are flat."""
    import jax
    from dsflash.bench.forward import random_router
    E, k, T = 8, 2, 20000
    rank = np.random.default_rng(99).permutation(E) + 1          # the router's fixed ranking
    for alpha in (0.0, 1.5):
        idx = np.asarray(random_router(jax.random.PRNGKey(0), T, E, k, alpha))
        assert idx.shape == (T, k) and (idx[:, 0] != idx[:, 1]).all()
        counts = np.bincount(idx.ravel(), minlength=E)[np.argsort(rank)]     # hottest rank first
        if alpha == 0:
            assert counts.max() / counts.min() < 1.1
        else:
            assert (np.diff(counts) < 0).all() and counts[0] > 3 * counts[-1]


def test_eplb_needs_an_expert_parallel_mesh(tmp_path, capsys):
    _, cfgp = tiny4(tmp_path)
    assert bench_main(["forward", "--preset", cfgp, "--eplb", "2", "--decode", "1@32", "--no-save"]) == 2
    assert "--eplb 2: needs a mesh with expert-parallel size > 1" in capsys.readouterr().err
    assert bench_main(["forward", "--preset", cfgp, "--mesh", "dep=2", "--eplb", "1", "--decode", "1@32",
                       "--no-save"]) == 2                  # 8 experts + 1 slot do not split over 2 ranks
