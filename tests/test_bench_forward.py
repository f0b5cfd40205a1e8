"""``python -m dsflash.bench forward`` end to end on CPU (single device, a 4-layer tiny config): decode over a
dummy-filled KV state (no prefill), prefill over cached context, real-routing balancedness, JSON (and PNG with
matplotlib). A benchmark never asserts a time: only that fields exist and are sane. Uniform routing, mirror and
lag: test_bench_forward_mesh*.py; the breakdown: test_bench_forward_breakdown.py (each file < 60 s on CPU)."""
import json

import jax
import numpy as np
import pytest

from dsflash.bench import forward as FB
from dsflash.bench.__main__ import main as bench_main
from dsflash.config import preset


def tiny4(path):
    """tiny with 4 backbone layers (half the compile time; same layer kinds: SWA, Engram, ratio 2, ratio 1)."""
    cfg = preset("tiny").replace(num_hidden_layers=4, compress_ratios=(0, 0, 2, 1, 0), kv_source_layer_ids=(2, 3),
                                 index_source_layer_ids=(2, 3), candidate_source_layer_id=3,
                                 dspark_target_layer_ids=(1, 2, 3))
    p = path / "tiny4.json"
    cfg.save_json(p)
    return cfg, str(p)


def test_parse_points():
    assert FB.parse_points(["1,8@128,1024", "4@0"]) == [(1, 128), (1, 1024), (8, 128), (8, 1024), (4, 0)]
    assert FB.parse_points("2@16;3@32") == [(2, 16), (3, 32)]
    for bad in ("8", "a@1", "0@5", "1@-1"):
        with pytest.raises(ValueError):
            FB.parse_points(bad)


def test_dummy_fill_needs_no_prefill(tmp_path):
    """The filled state has finite, non-trivial contents in every pool/ring and page tables point at each row's
    own pages (the decode step over such a state runs in test_bench_forward_end_to_end: finite logits)."""
    _, cfgp = tiny4(tmp_path)
    args = FB.build_parser().parse_args(["--preset", cfgp, "--fast-compile", "--reps", "1", "--warmup", "0"])
    b = FB.ForwardBench(args)
    C, S = 40, 4
    batch, state = b.make_inputs(S, [C, C])
    pt = np.asarray(batch.page_table)
    assert pt.shape[1] == -(-(C + S) // args.page_size)
    assert len(set(pt.reshape(-1).tolist())) == pt.size              # disjoint pages per row
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        a = np.asarray(leaf).astype(np.float32)
        assert np.isfinite(a).all(), jax.tree_util.keystr(path)
        assert (a != 0).mean() > 0.5, f"{jax.tree_util.keystr(path)} looks unfilled"
    assert np.asarray(batch.start).tolist() == [C, C] and np.asarray(batch.lengths).tolist() == [S, S]


def test_bench_forward_end_to_end(tmp_path):
    cfg, cfgp = tiny4(tmp_path)
    out = tmp_path / "res"
    rc = bench_main(["forward", "--preset", cfgp, "--decode", "2@48", "--prefill", "8@16", "--reps", "2",
                     "--warmup", "1", "--no-breakdown", "--no-uniform", "--fast-compile", "--out", str(out), "--tag", "t"])
    assert rc == 0
    files = sorted(p.name for p in out.iterdir())
    js = [f for f in files if f.endswith(".json")]
    assert len(js) == 1 and js[0].startswith("forward_") and js[0].endswith("_cpu_t.json")
    r = json.loads((out / js[0]).read_text())
    for k in ("date", "commit", "device", "config_hash", "mesh", "precision", "method", "points"):
        assert r[k], k
    assert r["config_hash"] == cfg.hash() and r["mesh"] == "single" and r["draft_rows"] == 1 + cfg.dspark_block_size
    pts = {p["phase"]: p for p in r["points"]}
    assert set(pts) == {"prefill", "decode"}
    d, p = pts["decode"], pts["prefill"]
    assert (d["B"], d["C"], d["S"], d["rows"]) == (2, 48, 4, 2)
    assert (p["N"], p["C"], p["S"]) == (8, 16, 8)
    assert d["draft_ms"]["median"] > 0 and d["draft_ms"]["block"] == cfg.dspark_block_size   # DSpark half
    assert d["spec_step_ms"] > d["step_ms"]["median"] and "draft_ms" not in p
    for pt in (d, p):
        s = pt["step_ms"]
        assert 0 < s["min"] <= s["median"] <= s["max"] and s["n"] == 2 and s["compile_s"] > 0
        assert pt["finite_logits"] and pt["tok_per_s"] > 0
        bal = pt["balancedness"]
        assert bal["ranks"] == 8 and 0 < bal["real"] <= 1      # one device: 8 hypothetical EP ranks
        assert bal["routed_tokens"] == pt["tokens"]                    # every valid token routed once per layer
        roof = pt["roofline"]                                           # the whole-step floor (step_floor)
        assert roof["bytes"] == sum(o["bytes"] for o in roof["ops"].values()) and roof["roofline_ms"] > 0
        assert roof["roofline_ms"] == max(roof["bytes_ms"], roof["flops_ms"]) <= roof["sum_op_floors_ms"]
        assert roof["ops"]["embed"]["weight_bytes"] == 0 and roof["notes"]["S"] == pt["S"]
        assert 0 < roof["frac_of_roofline"] and roof["old_definition"]["bytes"] > roof["weight_bytes"]
    # logits: every row at decode (the engine's verification), the last row at prefill
    assert (d["logits"], p["logits"]) == ("all", "last") and d["roofline"]["notes"]["logits"] == "all"
    assert d["roofline"]["ops"]["head"]["flops_bf16"] == 2 * d["rows"] * d["S"] * cfg.vocab_size * cfg.hidden_size
    assert d["draft_floor"]["total"]["floor_ms"] > 0 and d["spec_step_floor_ms"] > d["roofline"]["roofline_ms"]
    c = r["ceilings"]
    assert c["platform"] == "cpu" and c["read_TBps_jax"] > 0 and c["bf16_TFLOPs_jax"] > 0
    try:
        import matplotlib  # noqa: F401
        assert any(f.endswith(".png") for f in files) and r["png"].endswith(".png")
        assert r["ops_png"].endswith("_ops.png") and r["ops_png"] in files
    except ImportError:
        pass


def test_profile_prints_the_per_op_table_with_floors(capsys):
    """``--profile`` on CPU: no GPU kernels in the trace, so a note and the per-op floors alone (every op of
    step_profile's scopes that has a floor, the draft as its own program); the table is in the JSON too."""
    from dsflash.bench import step_profile
    rc = bench_main(["forward", "--preset", "tiny", "--fast-compile", "--decode", "1@64", "--profile", "--no-save",
                     "--no-uniform", "--no-breakdown", "--reps", "1", "--warmup", "0"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "ceilings (cpu): read" in out
    header = next(line for line in out.splitlines() if line.startswith("op ") and "floor ms" in line)
    assert header.split() == ["op", "ms", "share", "kern", "floor", "ms", "%floor", "bound", "MB", "GFLOP"]
    rows = {line.split()[0]: line.split() for line in out.splitlines()[out.splitlines().index(header) + 1:]
            if line.split() and line.split()[0] in step_profile.SCOPE_NAMES + ("draft",)}
    for op in ("q_proj", "kv_proj", "o_proj", "compressor", "index_keys", "indexer_q", "indexer_topk", "kv_write",
               "ring_write", "sparse_attention", "mhc", "norm", "gate", "shared_expert", "routed_experts", "head",
               "embed", "engram"):
        assert op in rows, op
        assert float(rows[op][4]) > 0 and rows[op][1] == "-", rows[op]      # a floor; no measured time on CPU
    assert float(rows["draft"][1]) > 0 and float(rows["draft"][4]) > 0      # the draft: timed, with its floor
    assert "no GPU kernels in the trace (cpu)" in out and "whole step:" in out


def test_profile_scopes_land_in_the_compiled_hlo(tmp_path):
    """The scoped program's HLO metadata names the model ops (what the GPU profile maps kernels through)."""
    _, cfgp = tiny4(tmp_path)
    from dsflash.bench import step_profile
    args = FB.build_parser().parse_args(["--preset", cfgp, "--fast-compile", "--reps", "1", "--warmup", "0"])
    b = FB.ForwardBench(args)
    batch, state = b.make_inputs(2, [40])
    b.run_variant("full", "decode", batch, state, scoped=True)
    meta = step_profile.hlo_metadata(b._compiled[b._last_key].as_text())
    scopes = {step_profile.scope_of(m.get("op_name", "")) for m in meta.values()}
    assert {"q_proj", "sparse_attention", "routed_experts", "mhc", "head", "indexer_topk"} <= scopes


_CB_HLO = """HloModule jit_step

%fused_add (p0: f32[4], p1: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  ROOT %add = f32[4]{0} add(%p0, %p1)
}

%command_buffer.3 (a: f32[4], b: (f32[4], s32[])) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %bt = (f32[4]{0}, s32[]) parameter(1)
  %b = f32[4]{0} get-tuple-element(%bt), index=0
  %loop_add_fusion = f32[4]{0} fusion(%a, %b), kind=kLoop, calls=%fused_add
  %custom-call.2 = f32[4]{0} custom-call(%loop_add_fusion), custom_call_target="triton_kernel_call"
  ROOT %custom-call.4 = f32[4]{0} custom-call(%custom-call.2), custom_call_target="triton_kernel_call_ffi"
}

ENTRY %main (x: f32[4], y: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %y = f32[4]{0} parameter(1)
  %tup = (f32[4]{0}, s32[]) tuple(%y, %y)
  %call = f32[4]{0} call(%x, %tup), to_apply=%command_buffer.3
  %custom-call.1 = f32[4]{0} custom-call(%call), custom_call_target="triton_kernel_call"
  %loop_add_fusion.1 = f32[4]{0} fusion(%custom-call.1, %y), kind=kLoop, calls=%fused_add
  ROOT %custom-call.3 = f32[4]{0} custom-call(%loop_add_fusion.1), custom_call_target="__cublas$gemm"
}
"""


def test_command_buffer_census_counts_launches_inside_and_outside_the_graphs():
    """Launches recorded into a ``command_buffer`` computation and those left outside (a host launch each); the
    fused body's own instructions are not launches."""
    from dsflash.bench import step_profile
    c = step_profile.command_buffer_census(_CB_HLO)
    assert c == {"command_buffers": 1, "launches_in": 3, "launches_out": 3, "triton_in": 2, "triton_out": 1}


def test_graph_census_counts_kernels_replayed_from_command_buffers():
    """Kernels replayed from a CUDA graph carry the command buffer's name as their HLO op in the trace; the rest
    were launched one by one (jax 0.11's XLA forms command buffers after HLO, so only the trace shows them)."""
    from dsflash.bench import step_profile
    k = lambda op: ("kern", 0.0, 1.0, {"hlo_op": op} if op else {})              # noqa: E731
    kernels = [k("command_buffer_1"), k("command_buffer_1"), k("triton_kernel_call.3"), k("command_buffer_7"),
               k(None)] * 2
    g = step_profile.graph_census(kernels, calls=2)
    assert g == {"graphs": 2, "kernels_in_graphs_per_step": 3.0, "kernels_outside_per_step": 2.0}
