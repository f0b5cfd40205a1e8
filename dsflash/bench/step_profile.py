"""Per-op profile of one compiled forward step: where a step's device time goes, op by op.

``bench forward --profile`` (issue 19, "whole step first") traces a few calls of an already compiled step with
``jax.profiler`` (a Perfetto JSON trace), takes every GPU kernel of those calls, maps it to the HLO instruction
that launched it (the trace's ``hlo_op`` annotation, else the kernel name) and that instruction's
``op_name`` metadata, and sums kernel time per *model op*.

Model ops are named scopes: ``scoped_model()`` wraps the model functions listed in ``SCOPES`` in
``jax.named_scope`` for the duration of a trace-and-compile (the model's code is not edited; the scope names
land in the HLO ``op_name`` of everything the function emits). A kernel is charged to the innermost scope
in its ``op_name``; kernels under no scope are charged to ``unscoped:<source file>:<line>``.

The table also reports the step's wall time and the kernel-busy time: their difference is device idle time
between kernels (launch gaps, host waits), which no kernel tuning removes.
"""
from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import importlib
import json
import os
import re
import tempfile
import time

# (module, attribute, scope name): the ops of a step's per-op table, patched where the caller looks the name up
# (``forward`` imports ``csa_attention`` by name, ``moe`` reaches ``moe_gemm.routed_moe`` through the module).
# A kernel is charged to the innermost scope in its op_name, so e.g. q_norm counts as q_proj.
SCOPES = (
    ("dsflash.model.forward", "embed_streams", "embed"),
    ("dsflash.model.forward", "engram_step", "engram"),
    ("dsflash.model.forward", "rms_norm", "norm"),
    ("dsflash.model.forward", "linear_f32", "head"),
    ("dsflash.model.forward", "csa_attention", "attention_other"),
    ("dsflash.model.forward", "moe", "moe_other"),
    ("dsflash.model.mhc", "pre_mix", "mhc"),
    ("dsflash.model.mhc", "post_mix", "mhc"),
    ("dsflash.model.mhc", "expand", "mhc"),
    ("dsflash.model.mhc", "collapse", "mhc"),
    ("dsflash.model.attention", "project_q", "q_proj"),
    ("dsflash.model.attention", "project_window_kv", "kv_proj"),
    ("dsflash.model.attention", "output_projection", "o_proj"),
    ("dsflash.model.attention", "compress", "compressor"),
    ("dsflash.model.attention", "index_keys", "index_keys"),
    ("dsflash.model.attention", "indexer_query", "indexer_q"),
    ("dsflash.model.attention", "gather_pool", "kv_gather"),
    ("dsflash.model.attention", "scatter_pool", "kv_write"),
    ("dsflash.model.attention", "scatter_ring", "ring_write"),
    ("dsflash.model.attention", "sparse_sink_attention", "sparse_attention"),
    ("dsflash.model.attention", "sparse_sink_attention_paged", "sparse_attention"),
    ("dsflash.kernels.sparse_attention", "gather_decoded", "kv_gather"),       # the paged path's reference
    ("dsflash.kernels.indexer_topk", "indexer_topk", "indexer_topk"),
    ("dsflash.kernels.indexer_topk", "indexer_topk_paged", "indexer_topk"),
    ("dsflash.model.moe", "route", "gate"),
    ("dsflash.model.moe", "shared_expert", "shared_expert"),
    ("dsflash.kernels.moe_gemm", "routed_moe", "routed_experts"),
)
SCOPE_NAMES = tuple(dict.fromkeys(s for _, _, s in SCOPES))


@contextlib.contextmanager
def scoped_model():
    """Wrap the ``SCOPES`` functions in named scopes while a step is traced (restore them afterwards)."""
    import jax
    saved = []
    try:
        for mod_name, attr, scope in SCOPES:
            mod = importlib.import_module(mod_name)
            fn = getattr(mod, attr, None)
            if fn is None:
                continue
            saved.append((mod, attr, fn))
            setattr(mod, attr, jax.named_scope(f"op_{scope}")(fn))
        yield
    finally:
        for mod, attr, fn in reversed(saved):
            setattr(mod, attr, fn)


# ------------------------------------------------------------------------------------------ HLO metadata
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_META = re.compile(r'metadata=\{([^}]*)\}')
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMP_NAME = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)")


def _computation(line: str, current):
    """(is a computation header, the computation the following lines belong to). The name only is read: a header's
    parameter list may nest parentheses (tuple parameters)."""
    if not (line.rstrip().endswith("{") and "=" not in line.split("{")[0]):
        return False, current
    m = _COMP_NAME.match(line)
    return True, (m.group(1) if m else current)


def hlo_metadata(hlo_text: str) -> dict:
    """instruction name -> {op_name, source_file, source_line, op} of the compiled module's text; fusions without
    metadata take their fused computation's dot / custom-call (else first) instruction's."""
    meta, calls, comp_meta = {}, {}, collections.defaultdict(list)
    comp = None
    for line in hlo_text.splitlines():
        header, comp = _computation(line, comp)
        if header:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        op = re.search(r"\b([a-z][\w\-]*)\(", rest)
        md = _META.search(rest)
        rec = {"op": op.group(1) if op else ""}
        if md:
            for k, v in _FIELD.findall(md.group(1)):
                rec[k] = v.strip('"')
        meta[name] = rec
        c = _CALLS.search(rest)
        if c:
            calls[name] = c.group(1)
        if comp and "op_name" in rec:
            comp_meta[comp].append(rec)
    for name, comp in calls.items():
        if "op_name" in meta[name] or not comp_meta.get(comp):
            continue
        recs = comp_meta[comp]
        pick = next((r for r in recs if r["op"] in ("dot", "custom-call", "convolution")), recs[-1])
        meta[name] = {**pick, "op": meta[name]["op"]}
    return meta


# custom-call targets of a Triton launch: jax-triton's legacy form, its FFI form, Pallas
TRITON_TARGETS = ("triton_kernel_call", "triton_kernel_call_ffi", "__gpu$xla.gpu.triton")


def command_buffer_census(hlo_text: str) -> dict:
    """How much of a compiled GPU module XLA recorded into command buffers (CUDA graphs): the count of
    ``command_buffer*`` computations, the launches (fusions and custom calls) inside them and outside, and the same
    for the Triton custom calls alone. Launches outside a command buffer are each a host-side launch per step, so at
    small batch they set the gaps between kernels. Only where XLA forms command buffers in HLO: jax 0.11's XLA forms
    them from thunks after HLO (H100, 2026-12-06: 0 here for programs the trace shows running as graphs), so there
    ``graph_census`` of a trace is the measure."""
    fused = {c.group(1) for line in hlo_text.splitlines() if " fusion(" in line for c in [_CALLS.search(line)] if c}
    comp, inside = None, False
    out = {"command_buffers": 0, "launches_in": 0, "launches_out": 0, "triton_in": 0, "triton_out": 0}
    for line in hlo_text.splitlines():
        header, comp = _computation(line, comp)
        if header:
            inside = bool(comp) and comp.startswith("command_buffer")
            out["command_buffers"] += inside
            continue
        m = _INSTR.match(line)
        if not m or comp is None:
            continue
        rest = m.group(2)
        if comp in fused or not (" fusion(" in rest or " custom-call(" in rest):
            continue            # an instruction of a fused body, or not a launch
        where = "in" if inside else "out"
        out[f"launches_{where}"] += 1
        if any(f'custom_call_target="{t}"' in rest for t in TRITON_TARGETS):
            out[f"triton_{where}"] += 1
    return out


def scope_of(op_name: str) -> str | None:
    """The innermost ``op_<scope>`` in an op_name path."""
    best = None
    for part in op_name.split("/"):
        if part.startswith("op_") and part[3:] in SCOPE_NAMES:
            best = part[3:]
    return best


# ------------------------------------------------------------------------------------------ trace
def _load_trace(log_dir):
    files = glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True) + \
        glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise RuntimeError(f"no trace file under {log_dir}: {glob.glob(os.path.join(log_dir, '**'), recursive=True)}")
    with gzip.open(sorted(files, key=os.path.getmtime)[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def gpu_kernels(events, one_device=True):
    """Complete events on GPU streams: [(name, ts_us, dur_us, args)]. ``one_device``: only the first GPU's (a mesh
    step's devices run the same program; the per-op table and its floors are one device's)."""
    pnames = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {p for p, n in pnames.items() if "GPU" in n or "/device:" in n and "CPU" not in n}
    if one_device and len(gpu_pids) > 1:
        first = next((p for p in gpu_pids if re.search(r"GPU:0\b", pnames[p])), None)
        gpu_pids = {first if first is not None else min(gpu_pids, key=lambda p: pnames[p])}
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e:
            out.append((e.get("name", ""), float(e["ts"]), float(e["dur"]), e.get("args", {})))
    return out, pnames


def profile_step(run_once, hlo_text: str, calls: int = 3, log_dir: str | None = None) -> dict:
    """Trace ``calls`` calls of ``run_once()`` (each must block until its outputs are ready) and return the
    per-op table: {ops: {scope: {ms_per_step, kernels_per_step}}, busy_ms, wall_ms, top: [...]}."""
    import jax
    log_dir = log_dir or tempfile.mkdtemp(prefix="dsflash_prof_")
    run_once()                                   # warm (the step is compiled already)
    t0 = time.perf_counter()
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(calls):
            run_once()
    wall_ms = (time.perf_counter() - t0) * 1e3 / calls
    events = _load_trace(log_dir)
    kernels, pnames = gpu_kernels(events)
    meta = hlo_metadata(hlo_text)
    norm = {k.replace(".", "_").replace("-", "_"): v for k, v in meta.items()}
    per_op = collections.defaultdict(lambda: [0.0, 0])
    per_instr = collections.defaultdict(lambda: [0.0, 0, "", ""])
    unmatched = collections.Counter()
    arg_keys = collections.Counter()
    for name, ts, dur, args in kernels:
        arg_keys.update(args.keys())
        hlo_op = args.get("hlo_op") or args.get("long_name") or name
        rec = meta.get(hlo_op) or norm.get(str(hlo_op).replace(".", "_").replace("-", "_")) or norm.get(name)
        if rec is None:
            unmatched[name] += dur
            scope = "unmatched"
        else:
            scope = scope_of(rec.get("op_name", "")) or \
                f"unscoped:{os.path.basename(rec.get('source_file', '?'))}:{rec.get('source_line', '?')}"
        per_op[scope][0] += dur
        per_op[scope][1] += 1
        key = f"{hlo_op}"
        per_instr[key][0] += dur
        per_instr[key][1] += 1
        per_instr[key][2] = scope
        per_instr[key][3] = name                 # the GPU kernel's own name (a Triton kernel's function name)
    busy = sum(d for _, _, d, _ in kernels) / 1e3 / calls
    gap = idle_gaps(kernels, calls)
    graphs = graph_census(kernels, calls)
    ops = {s: {"ms_per_step": v[0] / 1e3 / calls, "kernels_per_step": v[1] / calls}
           for s, v in sorted(per_op.items(), key=lambda kv: -kv[1][0])}
    top = [{"hlo_op": k, "scope": v[2], "kernel": v[3], "ms_per_step": v[0] / 1e3 / calls,
            "launches_per_step": v[1] / calls}
           for k, v in sorted(per_instr.items(), key=lambda kv: -kv[1][0])[:40]]
    return {"ops": ops, "busy_ms": busy, "wall_ms": wall_ms, "idle_ms": max(0.0, wall_ms - busy),
            "kernels_per_step": len(kernels) / calls, "top_instructions": top, "gaps": gap, "graphs": graphs,
            "unmatched_ms": {k: v / 1e3 / calls for k, v in unmatched.most_common(10)},
            "trace_arg_keys": dict(arg_keys.most_common(12)),
            "gpu_processes": sorted({n for n in pnames.values() if "GPU" in n or "/device:" in n})}


def graph_census(kernels, calls: int) -> dict:
    """Kernels a step ran inside XLA's command buffers (CUDA graphs) and outside, from the trace: a kernel replayed
    from a graph carries its command buffer's name (``command_buffer_N``) as its HLO op. (On jax >= 0.11 XLA forms
    command buffers from thunks after HLO, so ``command_buffer_census`` of the compiled text finds none there.)"""
    ops = [str(args.get("hlo_op") or "") for _, _, _, args in kernels]
    inside = [o for o in ops if o.startswith("command_buffer")]
    return {"graphs": len(set(inside)), "kernels_in_graphs_per_step": len(inside) / calls,
            "kernels_outside_per_step": (len(ops) - len(inside)) / calls}


def idle_gaps(kernels, calls: int, top: int = 12) -> dict:
    """Where the GPU waits inside the traced calls: the time between one kernel's end and the next one's start
    (all streams merged), summed, and the largest gaps with the kernels either side (launch gaps around custom
    calls, host round trips). Gaps longer than 5 ms are taken as the pause between two calls and dropped."""
    ev = sorted((ts, ts + dur, name, args.get("hlo_op", "")) for name, ts, dur, args in kernels)
    gaps, end, prev = [], None, None
    for ts, te, name, op in ev:
        if end is not None and ts > end:
            g = ts - end
            if g < 5000:
                gaps.append((g, prev, op or name))
        if end is None or te > end:
            end, prev = te, op or name
    total = sum(g for g, _, _ in gaps) / 1e3 / calls
    big = sorted(gaps, reverse=True)[:top]
    return {"between_kernels_ms": total, "count_per_step": len(gaps) / calls,
            "largest_us": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in big]}
# the printed per-op table with floors: dsflash.bench.step_floor.op_table / format_table
