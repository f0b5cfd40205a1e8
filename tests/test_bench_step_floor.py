"""``bench.step_floor`` (analytic bytes / flops per op of one step) and ``bench.ceilings`` on CPU.

The weight side is checked against the model's real parameters: the test maps every parameter name to the op
that reads it (its own table below, from the names alone) and sums the arrays' ``nbytes``; step_floor derives the
same numbers from the config's widths and the storage formats. No test asserts a time."""
import re

import numpy as np
import pytest

from dsflash.bench import ceilings as C
from dsflash.bench import step_floor as F
from dsflash.config import preset
from dsflash.model.params import abstract_params, init_params

# parameter name -> op reading it (first match wins); None: read by no op of a target step as a whole tensor
OWNER = [
    (r"^embed\.weight$", None),                      # only the gathered rows
    (r"\.engram\.embed\.", None),                    # Engram tables: the gathered rows
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", "mhc"),
    (r"(\.attn_norm|\.ffn_norm|^norm)\.weight$", "norm"),
    (r"\.attn\.attn_sink$", "sparse_attention"),
    (r"\.attn\.compressor\.", "compressor"),
    (r"\.attn\.indexer\.(wk|k_norm)\.", "index_keys"),
    (r"\.attn\.indexer\.(wq_b|weights_proj)\.", "indexer_q"),
    (r"\.attn\.(wq_a|q_norm|wq_b)\.", "q_proj"),
    (r"\.attn\.(wkv|kv_norm)\.", "kv_proj"),
    (r"\.attn\.(wo_a|wo_b)\.", "o_proj"),
    (r"\.ffn\.gate\.bias_vl$", None),                # not read by the forward
    (r"\.ffn\.gate\.(weight|bias)$", "gate"),
    (r"\.ffn\.shared_experts\.", "shared_expert"),
    (r"\.ffn\.experts\.", "routed_experts"),
    (r"\.engram\.(wkv\.|q_weight|k_weight)", "engram"),
    (r"^head\.weight$", "head"),
]


def owner(name):
    for pat, op in OWNER:
        if re.search(pat, name):
            return op
    raise AssertionError(f"no owner for {name}")


def per_op_nbytes(params: dict) -> dict:
    out = {}
    for k, v in params.items():
        if k.startswith("mtp."):
            continue
        op = owner(k)
        if op is not None:
            out[op] = out.get(op, 0) + int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
    return out


def dense_loads(cfg):
    return np.ones((cfg.num_hidden_layers, cfg.n_routed_experts))


@pytest.mark.parametrize("name", ["tiny", "bench-4l-96e"])
def test_weight_bytes_match_the_params_for_a_dense_step(name):
    """Every expert hit: each op's analytic weight bytes equal the nbytes of the parameters it reads (tiny: real
    arrays from init_params; the bench preset: abstract shapes, no 10 GB of numpy)."""
    cfg = preset(name)
    params = init_params(cfg, include_host=False, as_numpy=True) if name == "tiny" else abstract_params(cfg, False)
    want = per_op_nbytes(params)
    f = F.step_floor(cfg, rows=2, S=3, context=100, loads=dense_loads(cfg))
    got = {k: v["weight_bytes"] for k, v in f["ops"].items() if v["weight_bytes"]}
    assert got == want
    assert f["total"]["weight_bytes"] == sum(want.values())


def test_routed_weights_count_only_the_hit_experts():
    cfg = preset("tiny")
    params = init_params(cfg, include_host=False, as_numpy=True,
                         names=[f"layers.{l}.ffn.experts.{w}.weight" for l in range(8) for w in ("w1", "w2", "w3")])
    loads = np.zeros((cfg.num_hidden_layers, cfg.n_routed_experts))
    loads[0, [1, 5]] = [3, 1]
    loads[4, 2] = 4
    per_expert = sum(params[f"layers.0.ffn.experts.{w}.{k}"][0].nbytes for w in ("w1", "w2", "w3")
                     for k in ("weight", "scale"))
    f = F.step_floor(cfg, rows=1, S=4, context=10, loads=loads)
    assert f["ops"]["routed_experts"]["weight_bytes"] == 3 * per_expert
    assert f["ops"]["routed_experts"]["flops_fp8"] == 6 * loads.sum() * cfg.moe_intermediate_size * cfg.hidden_size
    # EP: experts contiguous per rank; the rank with the most hit experts (rank 0 holds experts 0-3 of 8)
    f2 = F.step_floor(cfg, rows=1, S=4, context=10, loads=loads, ep_ranks=2)
    assert f2["ops"]["routed_experts"]["weight_bytes"] == 2 * per_expert       # experts 1 and 2 (5 is rank 1's)


def test_draft_weight_bytes_match_the_params():
    """The DSpark half reads every mtp.* tensor (all draft experts hit) except the Markov embedding (rows only)
    and the unused gate bias_vl, plus the target's head; each stage's wkv / kv_norm twice (update_context and the
    proposal are separate parts)."""
    cfg = preset("tiny")
    params = init_params(cfg, include_host=False, as_numpy=True)
    want = sum(v.nbytes for k, v in params.items() if k.startswith("mtp.") and "markov_head.embed" not in k
               and not k.endswith("bias_vl")) + params["head.weight"].nbytes
    want += sum(v.nbytes for k, v in params.items() if re.match(r"mtp\.\d+\.attn\.(wkv|kv_norm)\.", k))
    d = F.draft_floor(cfg, rows=2, S=4, context=50, draft_loads=np.ones((cfg.n_stages, cfg.dspark_n_routed_experts)))
    assert sum(p["weight_bytes"] for p in d["parts"].values()) == want == d["total"]["weight_bytes"]
    assert "no DSpark" in F.draft_floor(preset("tiny").replace(num_nextn_predict_layers=0,
                                                              compress_ratios=preset("tiny").compress_ratios[:-1]),
                                        1, 1, 10)["notes"]["draft"]


def test_gemm_flops_by_hand():
    """q_proj of tiny (d 256, q_lora 64, 4 heads x 128) and the shared expert (I 64), 2 x 3 tokens, 8 layers;
    FP8 rate in reference numerics, bf16 rate in bf16 precision."""
    cfg = preset("tiny")
    T, L = 6, 8
    q = 2 * T * (64 * 256 + 512 * 64) * L
    sh = 2 * T * 3 * 64 * 256 * L
    f = F.step_floor(cfg, rows=2, S=3, context=40)
    assert f["ops"]["q_proj"]["flops_fp8"] == q and f["ops"]["q_proj"]["flops_bf16"] == 0
    assert f["ops"]["shared_expert"]["flops_fp8"] == sh
    assert f["ops"]["head"]["flops_bf16"] == 2 * 2 * 512 * 256            # logits="last": one row per sequence
    b = F.step_floor(cfg, rows=2, S=3, context=40, precision="bf16", logits="all")
    assert b["ops"]["q_proj"]["flops_bf16"] == q and b["ops"]["q_proj"]["flops_fp8"] == 0
    assert b["ops"]["head"]["flops_bf16"] == 2 * T * 512 * 256


def test_cache_bytes_of_one_decode_row():
    """tiny, 1 row at C=64: window 15 cached rows x (128 + 4) B per layer (8 layers); layers 2-4 (ratio 2, KV
    source 2) select min(8, 65 // 2) = 8 entries x (64 + 8) B, layers 5-7 (ratio 1) 8 entries; index keys of every
    visible entry at the index sources 2, 5, 7: 32, 65, 65 entries x (32 + 2) B; never the embedding table."""
    cfg = preset("tiny")
    f = F.step_floor(cfg, rows=1, S=1, context=64)
    assert f["ops"]["sparse_attention"]["cache_bytes"] == 8 * 15 * 132 + 6 * 8 * 72
    assert f["ops"]["indexer_topk"]["cache_bytes"] == (32 + 65 + 65) * 34
    assert f["ops"]["embed"]["cache_bytes"] == 256 * 2                     # one gathered row, not 512 x 256
    assert f["ops"]["kv_write"]["cache_bytes"] == 72 + 34       # one entry at source 5; position 64 is even: source 2
    #                                                               (ratio 2) completes no group
    # bf16 caches: plain 2-byte values
    g = F.step_floor(cfg, rows=1, S=1, context=64, precision="bf16")
    assert g["ops"]["sparse_attention"]["cache_bytes"] == 8 * 15 * 256 + 6 * 8 * 256
    # prefill: selections of one sequence never read more than its visible entries
    p = F.step_floor(cfg, rows=1, S=64, context=0)
    sel = p["ops"]["sparse_attention"]["cache_bytes"]
    assert sel == 3 * (32 * 72) + 3 * (64 * 72)                            # no cached window rows at C=0


def test_floor_arithmetic():
    cfg = preset("bench-4l-96e")
    ce = C.fixed(4.0, 800.0, 1600.0)
    r = C.rates(ce)
    assert r["read_Bps"] == 4e12 and r["bf16_flops"] == 8e14 and r["fp8_flops"] == 1.6e15
    f = F.step_floor(cfg, rows=4, S=6, context=4096, logits="all", ceilings=ce)
    for k, o in f["ops"].items():
        b = o["bytes"] / 4e12 * 1e3
        fl = (o["flops_fp8"] / 1.6e15 + o["flops_bf16"] / 8e14) * 1e3
        assert o["bytes"] == o["weight_bytes"] + o["cache_bytes"] + o["act_bytes"], k
        assert o["floor_ms"] == pytest.approx(max(b, fl)) and o["bound"] == ("bytes" if b >= fl else "flops"), k
    t = f["total"]
    assert t["bytes"] == sum(o["bytes"] for o in f["ops"].values())
    assert t["bytes_ms"] == pytest.approx(t["bytes"] / 4e12 * 1e3)
    assert t["flops_ms"] == pytest.approx(sum(o["flops_fp8"] for o in f["ops"].values()) / 1.6e15 * 1e3
                                          + sum(o["flops_bf16"] for o in f["ops"].values()) / 8e14 * 1e3)
    assert t["floor_ms"] == max(t["bytes_ms"], t["flops_ms"])
    assert t["sum_op_floors_ms"] == pytest.approx(sum(o["floor_ms"] for o in f["ops"].values()))
    assert t["floor_ms"] <= t["sum_op_floors_ms"]
    # the exact floor: every flop at the bf16 rate, so never below the FP8 floor, and above it in prefill
    assert t["exact_floor_ms"] == pytest.approx(max(t["bytes_ms"], t["flops"] / 8e14 * 1e3))
    assert t["exact_floor_ms"] >= t["floor_ms"]
    pre = F.step_floor(cfg, rows=1, S=4096, context=0, ceilings=ce)["total"]
    assert pre["flops_fp8"] > 0 and pre["exact_floor_ms"] > pre["floor_ms"]
    assert "bf16 rate" in F.format_table([], None, {"total": pre}, 100.0)
    # without ceilings: bytes and flops only
    assert "floor_ms" not in F.step_floor(cfg, 1, 1, 64)["total"]
    # no FP8 figure: the bf16 rate stands in
    assert C.rates({"read_TBps_jax": 1.0, "bf16_TFLOPs_jax": 100.0, "fp8_jax_error": "x"})["fp8_flops"] == 1e14


def test_uniform_routing_and_engine_iteration():
    cfg = preset("bench-4l-96e")
    assert F.expected_hits(96, 6, 0) == 0 and F.expected_hits(96, 6, 1) == pytest.approx(6)
    assert 95 < F.expected_hits(96, 6, 192) <= 96
    ce = C.fixed(4.5, 800.0, 1400.0)
    e = F.engine_iteration_floor(cfg, rows=8, context=2048, speculative=True, ceilings=ce)
    assert e["rows_per_sequence"] == 1 + cfg.dspark_block_size and {"draft", "sampling", "head"} <= set(e["ops"])
    p = F.engine_iteration_floor(cfg, rows=8, context=2048, speculative=False, ceilings=ce)
    assert p["rows_per_sequence"] == 1 and "draft" not in p["ops"]
    assert e["total"]["floor_ms"] > p["total"]["floor_ms"] > 0
    d = F.draft_floor(cfg, 8, 6, 2048, ceilings=ce)
    assert e["ops"]["draft"]["bytes"] == d["total"]["bytes"]


def test_op_table_joins_profile_and_floors():
    cfg = preset("tiny")
    f = F.step_floor(cfg, 1, 1, 64, ceilings=C.fixed(1.0, 10.0, 20.0))
    prof = {"ops": {"routed_experts": {"ms_per_step": 0.5, "kernels_per_step": 3}, "unscoped:x.py:1":
                    {"ms_per_step": 0.1, "kernels_per_step": 1}}, "busy_ms": 0.6, "wall_ms": 0.8, "idle_ms": 0.2,
            "kernels_per_step": 4}
    rows = F.op_table(prof, f, {"draft": (1.0, F.draft_floor(cfg, 1, 1, 64, ceilings=C.fixed(1.0, 10.0, 20.0))["total"])})
    by = {r["op"]: r for r in rows}
    assert rows[0]["op"] == "routed_experts" and by["routed_experts"]["share"] == pytest.approx(0.5 / 0.6)
    assert by["routed_experts"]["pct_of_floor"] == pytest.approx(100 * f["ops"]["routed_experts"]["floor_ms"] / 0.5)
    assert by["unscoped:x.py:1"]["floor_ms"] is None and by["head"]["ms"] is None
    assert by["draft"]["separate_program"] and by["draft"]["ms"] == 1.0
    text = F.format_table(rows, prof, f, step_ms=1.0)
    assert "floor ms" in text and "whole step:" in text and "floor / step = " in text


def test_ceilings_on_cpu():
    c = C.measure(read_bytes=1 << 20, gemm_n=128)
    assert c["platform"] == "cpu" and c["read_buffer_bytes"] == 1 << 20 and c["gemm_n"] == 128
    for k in ("read_TBps_jax", "copy_TBps_jax", "bf16_TFLOPs_jax"):
        assert c[k] > 0, k
    assert c.get("fp8_TFLOPs_jax", 0) > 0 or c["fp8_jax_error"]
    assert "torch_note" in c
    r = C.rates(c)
    assert r["read_Bps"] == c["read_TBps_jax"] * 1e12 and r["read_from"] == "read_TBps_jax"
    assert C.measure(read_bytes=1 << 20, gemm_n=128) == c                  # measured once per process
    assert "ceilings (cpu)" in C.format_ceilings(c)


def test_engine_floor_at_a_live_engines_shapes():
    """``bench engine``'s field: an engine's slots, context and ring slack; None for the toy backend."""
    from types import SimpleNamespace
    cfg = preset("tiny")
    be = SimpleNamespace(cfg=cfg, precision="reference")
    eng = SimpleNamespace(backend=be, max_num_seqs=4, dp=2, speculative=True, geo=SimpleNamespace(ring_slack=16))
    ce = C.fixed(1.0, 10.0, 20.0)
    f = F.engine_floor(eng, 100.5, True, ce)
    want = F.engine_iteration_floor(cfg, 2, 100, True, ceilings=ce)
    assert f["total"] == want["total"] and f["context"] == 100 and f["rows_per_sequence"] == 1 + cfg.dspark_block_size
    assert F.engine_floor(eng, 100, False, ce)["rows_per_sequence"] == 1
    assert F.engine_floor(SimpleNamespace(backend=SimpleNamespace(cfg=object())), 10, True, ce) is None


def test_profile_keeps_one_devices_kernels():
    """A mesh step's trace has every GPU's kernels; the per-op table (and its per-device floors) takes GPU 0's."""
    from dsflash.bench.step_profile import gpu_kernels
    meta = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
            for p, n in ((1, "/device:GPU:1"), (2, "/device:GPU:0"), (3, "/host:CPU"))]
    ev = meta + [{"ph": "X", "pid": p, "ts": 0, "dur": 5, "name": f"k{p}"} for p in (1, 2, 3)]
    assert [k[0] for k in gpu_kernels(ev)[0]] == ["k2"]
    assert sorted(k[0] for k in gpu_kernels(ev, one_device=False)[0]) == ["k1", "k2"]
