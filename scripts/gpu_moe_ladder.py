"""The il decode ladder (session 29): where between a load-only loop and the real kernel do the routed-expert decode
kernels lose their bandwidth?

``_moe_up_kernel_il`` / ``_moe_down_kernel_il`` stream their MXFP4 weights at ~1.85 TB/s on an H100 (58-60 % of the
measured read rate) whatever their occupancy or instructions per element, while a separate load-only kernel of the
same access pattern (``gpu_moe_stream_probe.py``) streamed 2.77 TB/s. The ladder takes the kernels' own loop apart
(``MoeConfig.probe``; ``moe_layout_kernels`` "the decode ladder"): same grid, tiles, K loop, ``_il_load`` and
pipelined ``tl.range`` in every rung, pieces of the body replaced by a trivial xor of what they would consume:

  rung 0  the kernel (checked against the reference first)      rung 3  loads + x / h slab + MMA on raw bits
  rung 1  weight + scale loads only                              rung 4  loads + decode + x / h slab (no MMA)
  rung 2  loads + the weight decode

So 1 -> 2 adds the decode, 2 -> 4 the x slab, 4 -> 0 the MMA; 3 -> 0 is the decode with all else in place. Rungs
above 0 write garbage (by design).

Ladder 2 (session 30; the H100 run of the above put the up kernel's whole cost on rung 1: its load stream alone ran at
the kernel's ~1.8 TB/s while the down kernel's streamed 2.4-2.5) varies rung 1's load stream:

  rung 5  weights only (no scale loads)           rung 7  W1 + its scales only (one matrix, half the bytes)
  rung 6  scale words from a contiguous run       rung 8  rung 7's loop in split_gate_up programs (one matrix a
          (same words and 4-byte copies a step)           program, all the bytes, twice the programs)

In the down kernel (one matrix) 7 and 8 are rung 1 again (a repeat); 5 and 6 are the same changes. TB/s counts the
bytes each rung reads (5: weights only; 7: W1 and its scales).

  python3 scripts/gpu_moe_ladder.py --rungs 0,1,5,6,7,8 --out "$OUT"          # GPU: ladder 2 (gpu_queue.sh moe_ladder2)

``--ncu-target`` makes the script a minimal program for Nsight Compute (no profiler trace, no reference, no XLA sort:
routing drawn on the host; no sm_90 child): it compiles every (rung, pin) of ``--ncu-variants`` at the first
``--plan`` point, calls each once (warm-up), prints the launch order, then calls each once more -- so ncu's
``--launch-skip 2N --launch-count 2N`` with ``--kernel-name regex:_moe_(up|down)_kernel_il`` sees each variant's up
and down kernels in that order. ``--ncu-summary LOG ...`` turns such ncu logs (text output) into one table.

Occupancy: the rungs without the x slab or the MMA need fewer registers and less shared memory, so more programs fit
an SM (the sm_90 compile's figures are printed first). "free" runs each rung as compiled; "pinned" launches it with
its dynamic shared memory padded (jax-triton's compile result patched in this process only) so that its programs per
SM by shared memory equal rung 0's -- the same number of programs, hence of pipeline stages in flight, per SM.
Padding also shrinks the L1 carve-out (the weights' 16-byte copies bypass L1; the 4-byte scale copies do not).

Timing: each launch's kernel duration from a ``jax.profiler`` trace (CUPTI device activity), median over ``--calls``
calls of the jitted pair of launches on prepared inputs (no routing sort / quantisation in the calls); the weights
are far larger than L2 at both sizes. TB/s = the MXFP4 bytes + scales of the experts the batch hits (each once) /
kernel time; ``tile_TBps`` counts each expert's bytes once per token tile that reads it. The streaming read rate is
``dsflash.bench.ceilings``' ``read_TBps_jax`` method (jnp.sum of a 4 GB bf16 buffer, median of 7 x 4 calls),
measured in the same run.

  python3 scripts/gpu_moe_ladder.py --out "$OUT"                 # GPU: 6 tokens sw_il, 192 tokens sw_il_bm32

Tile-major weights (session 30; ``MoeConfig.tile_major``, ``moe_layout.to_tiles``): a --plan base with tile_major
(``sw_il_tm``, ``sw_il_tm2``, ``sw_il_bm32_tm``, ``sw_il_bm32_tm2``; rungs 1, 2, 5, 7 have ``_probeN`` twins) is timed
on the weights tiled at its level; its rung 0 is also compared bit for bit with its plain-il twin's output when that
twin (the same config with tile_major 0) comes earlier in --plan at the same token count. A rung without a named
config (e.g. 6 on a tiled base) is skipped. Several bases may share a token count:

  python3 scripts/gpu_moe_ladder.py --plan 6:sw_il,6:sw_il_tm,6:sw_il_tm2,192:sw_il_bm32,192:sw_il_bm32_tm,\
      192:sw_il_bm32_tm2 --rungs 0,1 --out "$OUT"                                  # GPU: gpu_queue.sh moe_tm
  JAX_PLATFORMS=cpu python3 scripts/gpu_moe_ladder.py --sm90-only  # CPU: the compile table alone (no GPU)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

D, INTER, E, TOPK, LIMIT = 5120, 2304, 96, 6, 10.0
TOL = 5e-3                        # tests/gpu/test_moe_gemm.py's relative Frobenius tolerance
SMEM_SM, SMEM_RESERVED, REGS_SM = 233472, 1024, 65536     # sm_90 per SM (as scripts/sm90_compile._occupancy)
KERNELS = ("_moe_up_kernel_il", "_moe_down_kernel_il")


def rung_config(base, rung):
    return base if rung == 0 else f"{base}_probe{rung}"


def known_config(name):
    from dsflash.kernels import moe_plan
    return name in moe_plan.named_configs()


def tiled_weights(il, cfg, cache):
    """The il weights as ``cfg`` reads them: plain, or tile-major at its ``tile_major`` level (permuted once per
    level; ``cache`` holds them)."""
    level = int(cfg.tile_major)
    if not level:
        return il
    if level not in cache:
        import jax
        from dsflash.kernels import moe_layout
        cache[level] = tuple(moe_layout.tile_experts(*il, level=level))
        jax.block_until_ready(cache[level])
    return cache[level]


def blocks_per_sm(regs, warps, smem):
    """Programs per SM on sm_90 from registers (per warp in units of 256), shared memory (+1 KB reserved a
    program) and the 32-program / 64-warp caps: ``sm90_compile._occupancy``'s rule."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = REGS_SM // (per_warp * warps)
    by_smem = SMEM_SM // (smem + SMEM_RESERVED) if smem else 32
    return max(0, min(by_regs, by_smem, 32, 64 // warps))


def pin_smem(own_smem, blocks0):
    """The largest shared-memory size a program can ask for and still fit ``blocks0`` programs an SM (never less than
    its own)."""
    return max(own_smem, SMEM_SM // blocks0 - SMEM_RESERVED)


# ------------------------------------------------------------------------------------------ sm_90 compile (CPU)
def _compile_one(job):
    name, T = job
    import sm90_compile as sc
    out = {}
    for r in sc.moe_reports(name, T):
        if r.name not in KERNELS:
            continue
        lp = r.main_loop
        big = max(r.loops, key=lambda lp_: lp_.n) if r.loops else None
        out[r.name] = dict(regs=r.regs, spills=r.spill_stores + r.spill_loads, smem=r.smem, warps=r.num_warps,
                           stages=r.num_stages, blocks=blocks_per_sm(r.regs, r.num_warps, r.smem),
                           loop_sass=lp.n if lp else None, loops=[lp_.n for lp_ in r.loops],
                           loop_ldgsts=(lp or big).ops["LDGSTS"] if (lp or big) else 0,
                           loop_hgmma=(lp or big).ops["HGMMA"] if (lp or big) else 0,
                           unrolled=not r.loops, total_sass=sum(r.ops.values()), kernel_ldgsts=r.ops["LDGSTS"])
    return name, T, out


def sm90_table(plan, rungs, workers=8):
    """{config name: {kernel: facts}} from the offline sm_90 compile of every rung (a process per config)."""
    jobs = [(rung_config(base, r), T) for T, base in plan for r in rungs if known_config(rung_config(base, r))]
    res = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as ex:
        for name, T, out in ex.map(_compile_one, jobs):
            res[name] = out
    return res


def print_sm90(table, plan, rungs):
    from dsflash.kernels.experimental.moe_layout_kernels import PROBES
    print("sm_90 compile (scripts/sm90_compile.py, per program; loop = main-loop SASS per warp per iteration; "
          "'unr.' = ptxas unrolled the whole K loop, LDGSTS then 'k' + the kernel's count):")
    print(f"{'config':<20} {'T':>4} {'rung':<17} {'kernel':<5} {'regs':>4} {'smem B':>7} {'prog/SM':>7} "
          f"{'loop':>5} {'LDGSTS':>6} {'HGMMA':>5}")
    for T, base in plan:
        for r in rungs:
            name = rung_config(base, r)
            for kn in KERNELS:
                f = table.get(name, {}).get(kn)
                if not f:
                    continue
                loop = "unr." if f["unrolled"] else f["loop_sass"]
                ldg = f"k{f['kernel_ldgsts']}" if f["unrolled"] else f["loop_ldgsts"]
                print(f"{name:<20} {T:>4} {PROBES[r]:<17} {kn.split('_')[2]:<5} {f['regs']:>4} {f['smem']:>7} "
                      f"{f['blocks']:>7} {loop!s:>5} {ldg!s:>6} {f['loop_hgmma']:>5}")


# ------------------------------------------------------------------------------------------ GPU side
_PAD: dict = {}


def install_smem_pad():
    """Patch jax-triton's compile step (this process only) so that a kernel named in ``_PAD`` is launched with that
    much dynamic shared memory if it needs less: the launch's occupancy, nothing else, changes."""
    from jax_triton import triton_lib as tlib
    if getattr(tlib.compile_ttir_inplace, "_ladder_pad", False):
        return
    orig = tlib.compile_ttir_inplace

    def padded(*a, **kw):
        r = orig(*a, **kw)
        want = _PAD.get(r.name)
        if want and want > r.shared_mem_bytes:
            r = dataclasses.replace(r, shared_mem_bytes=int(want))
        return r
    padded._ladder_pad = True
    tlib.compile_ttir_inplace = padded


def clear_kernel_cache():
    from jax_triton import triton_lib as tlib
    tlib._COMPILED_KERNEL_CACHE.clear()


def read_rate(nbytes):
    """``dsflash.bench.ceilings``' streaming read: jnp.sum (fp32) of a 1-D bf16 buffer, bytes / median time."""
    import jax
    import jax.numpy as jnp
    from dsflash.bench import ceilings
    x = jax.jit(lambda k: jax.random.normal(k, (nbytes // 2,), jnp.bfloat16))(jax.random.PRNGKey(0))
    jax.block_until_ready(x)
    s = ceilings._time(jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32)), x, reps=7, inner=4)
    del x
    return nbytes / s / 1e12


def kernel_durations(run_all, log_dir):
    """Run ``run_all()`` under a jax.profiler trace; the il kernels' device events in start order:
    [(kernel name, dur us)]."""
    import jax
    from dsflash.bench import step_profile
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        run_all()
    kernels, _ = step_profile.gpu_kernels(step_profile._load_trace(log_dir))
    out = []
    for name, ts, dur, _args in sorted(kernels, key=lambda k: k[1]):
        kn = next((k for k in KERNELS if k in name), None)
        if kn:
            out.append((kn, ts, dur))
    return out


def weight_bytes(idx, BM):
    """MXFP4 + scale bytes each launch reads from the experts the batch hits: (once each, once per token tile)."""
    import numpy as np
    counts = np.bincount(np.asarray(idx).reshape(-1), minlength=E)
    hit = int(np.count_nonzero(counts))
    tiles = int(np.sum(-(-counts // BM)))
    up = 2 * INTER * D // 2 + 2 * INTER * D // 32            # W1 + W3: nibbles + one scale byte per 32
    down = D * INTER // 2 + D * INTER // 32
    return dict(hit_experts=hit, tiles=tiles, up=hit * up, down=hit * down, up_tiles=tiles * up,
                down_tiles=tiles * down)


def rung_fraction(rung, kernel):
    """The share of ``weight_bytes``' bytes a rung's kernel reads: 5 the weights without their scales (32 / 34 of
    the MXFP4 + scale bytes: a scale byte per 16 nibble bytes), 7 one of the up kernel's two matrices; else all."""
    if rung == 5:
        return 16 / 17
    if rung == 7 and kernel == KERNELS[0]:
        return 0.5
    return 1.0


# ------------------------------------------------------------------------------------------ ncu target (GPU)
def parse_variants(spec):
    """"0:free,1:pinned,..." -> [(rung, pin)] (rung 0 is always run as compiled)."""
    out = []
    for v in spec.split(","):
        r, _, pin = v.strip().partition(":")
        pin = pin or "free"
        if pin not in ("free", "pinned"):
            raise ValueError(f"variant {v!r}: pin is 'free' or 'pinned'")
        out.append((int(r), "free" if int(r) == 0 else pin))
    return out


def ncu_problem(T):
    """x, idx, weight and the il weights at V4.1's widths, ``moe_plan.random_moe_problem``'s recipe but with the
    routing drawn on the host (distinct experts a token), so the process runs no XLA sort / top-k (ncu segfaulted on
    a script with sorts, session 29)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from dsflash.kernels import moe_layout
    rng = np.random.default_rng(0)
    idx = jnp.asarray(np.stack([rng.choice(E, TOPK, replace=False) for _ in range(T)]).astype(np.int32))
    s = rng.uniform(0.1, 1.0, (T, TOPK)).astype(np.float32)
    weight = jnp.asarray(s / s.sum(-1, keepdims=True) * 1.5)
    ks = jax.random.split(jax.random.PRNGKey(0), 7)
    x = jax.random.normal(ks[0], (T, D), jnp.float32).astype(jnp.bfloat16)

    def mx(kw, ks_, shape):
        w = jax.random.randint(kw, shape[:-1] + (shape[-1] // 2,), -128, 128, jnp.int32).astype(jnp.int8)
        sc = jax.random.randint(ks_, shape[:-1] + (shape[-1] // 32,), 119, 124, jnp.int32).astype(jnp.uint8)
        return w, sc
    w1, s1 = mx(ks[1], ks[2], (E, INTER, D))
    w3, s3 = mx(ks[3], ks[4], (E, INTER, D))
    w2, s2 = mx(ks[5], ks[6], (E, D, INTER))
    il = tuple(moe_layout.repack_experts(w1, s1, w3, s3, w2, s2))
    jax.block_until_ready(il)
    return x, idx, weight, il


def ncu_target(plan, variants, pin_blocks):
    """The Nsight Compute program: every variant compiled and called once (warm-up), then each called once more in
    the printed order (2 il launches each: up, down)."""
    import jax
    from dsflash.kernels import moe_gemm_triton as mt, moe_plan
    T, base = plan[0]
    x, idx, weight, il = ncu_problem(T)
    cfg0 = moe_plan.named_config(base)
    p = jax.jit(lambda x_, i_, w_: moe_plan.prepare(x_, i_, w_, E=E, BM=cfg0.BM, act_fp8=True))(x, idx, weight)
    il = tiled_weights(il, cfg0, {})
    install_smem_pad()
    fns = []
    for r, pin in variants:
        cfg = moe_plan.named_config(rung_config(base, r))
        _PAD.clear()
        if pin == "pinned":
            for kn, b in zip(KERNELS, pin_blocks):
                _PAD[kn] = SMEM_SM // b - SMEM_RESERVED      # padded only where the kernel asks for less
        clear_kernel_cache()

        def fn(p_, *w, cfg=cfg):
            return mt._launch(p_, *w, T=T, k=TOPK, d=D, I=INTER, E=E, limit=LIMIT, act_fp8=True, cfg=cfg)[0]
        jf = jax.jit(fn)
        jax.block_until_ready(jf(p, *il))
        _PAD.clear()
        clear_kernel_cache()
        fns.append(jf)
    n = len(variants)
    print(f"ncu target T={T} {base}: {n} variants warmed up ({2 * n} il launches); profiled calls in this order "
          f"(ncu: --launch-skip {2 * n} --launch-count {2 * n}):", flush=True)
    for j, ((r, pin), jf) in enumerate(zip(variants, fns)):
        print(f"  launches {2 * j}, {2 * j + 1}: {rung_config(base, r)} ({pin})", flush=True)
        jax.block_until_ready(jf(p, *il))


_UNITS = {"byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0, "Tbyte": 1e3,        # -> GB
          "ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def parse_ncu(text):
    """ncu's text report -> [(kernel name, {metric: value})] in report (= launch) order; bytes in GB, times in us."""
    import re
    kernels = []
    head = re.compile(r"^\s+(_\w+) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
    row = re.compile(r"^\s+([a-z0-9_]+__[\w.]+)\s+(\S.*?)?\s+([-\d.,]+|n/a)\s*$")
    for line in text.splitlines():
        m = head.match(line)
        if m:
            kernels.append((m.group(1), {}))
            continue
        m = row.match(line)
        if m and kernels:
            name, unit, val = m.group(1), (m.group(2) or "").strip(), m.group(3)
            if val == "n/a":
                continue
            v = float(val.replace(",", ""))
            kernels[-1][1][name] = v * _UNITS.get(unit, 1.0)
    return kernels


def ncu_summary(logs, plan, variants):
    """One table from ncu logs of ``ncu_target`` (each log: 2 kernels a variant, in order; several logs = several
    metric passes over the same launches, merged)."""
    T, base = plan[0]
    merged = {}
    for path in logs:
        try:
            with open(path) as f:
                ks = parse_ncu(f.read())
        except OSError:
            continue
        ks = [k for k in ks if k[0] in KERNELS]
        if len(ks) != 2 * len(variants):
            print(f"{path}: {len(ks)} il kernels profiled, expected {2 * len(variants)}: rows may be missing")
        for j, (kn, m) in enumerate(ks[:2 * len(variants)]):
            merged.setdefault((j // 2, kn), {}).update(m)
    cols = [("us", "gpu__time_duration.sum", 1), ("DRAM GB", "dram__bytes_read.sum", 1),
            ("DRAM %pk", "dram__throughput.avg.pct_of_peak_sustained_elapsed", 1),
            ("L2 hit%", "lts__t_sector_hit_rate.pct", 1),
            ("issue%", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
            ("warps%", "sm__warps_active.avg.pct_of_peak_sustained_active", 1)]
    stalls = ("long_scoreboard", "mio_throttle", "lg_throttle", "barrier", "wait", "short_scoreboard", "not_selected",
              "selected", "dispatch_stall", "no_instruction", "branch_resolving", "math_pipe_throttle", "drain",
              "membar")
    print(f"ncu, T={T} {base} (one launch each; DRAM TB/s = dram bytes / duration):")
    print(f"{'variant':<24} {'kernel':<5} " + " ".join(f"{c:>8}" for c, _, _ in cols)
          + f" {'TB/s':>6} {'ld sec/req':>10} {'ldgsts s/r':>10} {'L2 rd sec (M)':>13}")
    for (j, kn), m in sorted(merged.items(), key=lambda kv: (kv[0][0], KERNELS.index(kv[0][1]))):
        r, pin = variants[j]
        vals = " ".join(f"{m[k] * f:>8.2f}" if k in m else f"{'-':>8}" for _, k, f in cols)
        tb = (m["dram__bytes_read.sum"] / m["gpu__time_duration.sum"] * 1e3
              if "dram__bytes_read.sum" in m and m.get("gpu__time_duration.sum") else float("nan"))

        def ratio(a_, b_):
            return f"{m[a_] / m[b_]:.2f}" if m.get(b_) and a_ in m else "-"
        ld = ratio("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum")
        lg = ratio("l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum",
                   "l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum")
        l2 = m.get("lts__t_sectors_srcunit_tex_op_read.sum")
        print(f"{rung_config(base, r) + ' ' + pin:<24} {kn.split('_')[2]:<5} {vals} {tb:>6.2f} {ld:>10} {lg:>10} "
              f"{(l2 / 1e6 if l2 is not None else float('nan')):>13.1f}")
    print("stall reasons per issued instruction (smsp__average_warps_issue_stalled_*_per_issue_active.ratio):")
    print(f"{'variant':<24} {'kernel':<5} " + " ".join(f"{s_[:8]:>8}" for s_ in stalls))
    for (j, kn), m in sorted(merged.items(), key=lambda kv: (kv[0][0], KERNELS.index(kv[0][1]))):
        r, pin = variants[j]
        vals = []
        for s_ in stalls:
            k = f"smsp__average_warps_issue_stalled_{s_}_per_issue_active.ratio"
            vals.append(f"{m[k]:>8.2f}" if k in m else f"{'-':>8}")
        print(f"{rung_config(base, r) + ' ' + pin:<24} {kn.split('_')[2]:<5} " + " ".join(vals))
    return merged


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default="6:sw_il,192:sw_il_bm32", help="TOKENS:BASE_CONFIG pairs (the decode bands)")
    ap.add_argument("--rungs", default="0,1,2,3,4")
    ap.add_argument("--pin", default="both", choices=("both", "free", "pinned"))
    ap.add_argument("--calls", type=int, default=10, help="timed calls of each variant")
    ap.add_argument("--read-bytes", type=float, default=4e9)
    ap.add_argument("--out", default="")
    ap.add_argument("--sm90-only", action="store_true", help="the sm_90 compile table only (CPU, no GPU)")
    ap.add_argument("--sm90-json", default="", help=argparse.SUPPRESS)     # child mode: write the table there
    ap.add_argument("--ncu-target", action="store_true",
                    help="a minimal program for Nsight Compute: --ncu-variants at the first --plan point (see above)")
    ap.add_argument("--ncu-variants", default="0:free,1:pinned,1:free,5:pinned,6:pinned,7:pinned,8:pinned",
                    help="RUNG:free|pinned, comma-separated (--ncu-target, --ncu-summary)")
    ap.add_argument("--pin-blocks", default="4,4",
                    help="programs per SM a pinned variant is padded to, up and down kernel (--ncu-target; rung 0's: "
                         "4,4 for sw_il_bm32, 4,7 for sw_il)")
    ap.add_argument("--ncu-summary", nargs="+", default=None, metavar="LOG",
                    help="ncu text logs of --ncu-target runs (same variants, one per metric pass): one table")
    a = ap.parse_args(argv)
    plan = [(int(t), b) for t, b in (p.split(":") for p in a.plan.split(","))]
    rungs = [int(r) for r in a.rungs.split(",")]
    t_start = time.time()

    if a.ncu_summary:
        return ncu_summary(a.ncu_summary, plan, parse_variants(a.ncu_variants))
    if a.ncu_target:
        return ncu_target(plan, parse_variants(a.ncu_variants), [int(b) for b in a.pin_blocks.split(",")])

    if a.sm90_only or a.sm90_json:
        os.environ["JAX_PLATFORMS"] = "cpu"
        table = sm90_table(plan, rungs)
        if a.sm90_json:
            with open(a.sm90_json, "w") as f:
                json.dump(table, f)
        else:
            print_sm90(table, plan, rungs)
        return table

    # the sm_90 compile in a CPU-only child, while the GPU sets up
    out_dir = a.out or "."
    os.makedirs(out_dir, exist_ok=True)
    sm90_path = os.path.join(out_dir, "moe_ladder_sm90.json")
    child_log = open(os.path.join(out_dir, "moe_ladder_sm90.log"), "w")
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--plan", a.plan, "--rungs", a.rungs,
                              "--sm90-json", sm90_path], env={**os.environ, "JAX_PLATFORMS": "cpu"},
                             stdout=child_log, stderr=subprocess.STDOUT)

    import jax
    import numpy as np
    from dsflash.kernels import moe_gemm, moe_gemm_triton as mt, moe_layout, moe_plan
    from dsflash.kernels.experimental.moe_layout_kernels import PROBES

    dev = jax.devices()[0]
    result = dict(device=dev.device_kind, plan=plan, rungs=rungs, calls=a.calls, method=(
        "kernel time: jax.profiler (CUPTI) device duration of each launch, median over calls; bytes: MXFP4 + scales "
        "of the experts hit, once each; read: jnp.sum fp32 of a bf16 buffer (dsflash.bench.ceilings)"))
    rb = int(a.read_bytes)
    result["read_TBps"] = read_rate(rb)
    result["read_buffer_bytes"] = rb
    print(f"{dev.device_kind}: streaming read {result['read_TBps']:.3f} TB/s ({rb / 1e9:.1f} GB buffer)", flush=True)

    Tmax = max(T for T, _ in plan)
    args = moe_plan.random_moe_problem(jax.random.PRNGKey(0), Tmax, TOPK, E, D, INTER)
    il_plain = tuple(moe_layout.repack_experts(*args[3:]))
    jax.block_until_ready(il_plain)
    tiled = {}                  # tile-major copies by level (bases with tile_major)
    outputs = {}                # (T, config) -> rung 0's output, for the tiled twins' bit-for-bit check

    child.wait(timeout=600)
    child_log.close()
    table = {}
    if child.returncode == 0 and os.path.exists(sm90_path):
        with open(sm90_path) as f:
            table = json.load(f)
        print_sm90(table, plan, rungs)
    else:
        with open(child_log.name) as f:
            tail = f.read()[-2000:]
        print(f"sm_90 compile child failed (rc {child.returncode}); no occupancy facts, no pinning:\n{tail}")
    print(f"[{time.time() - t_start:.0f} s] setup done", flush=True)
    result["sm90"] = table
    pins = {"both": ("free", "pinned"), "free": ("free",), "pinned": ("pinned",)}[a.pin]
    install_smem_pad()

    rows = []
    for T, base in plan:
        x, idx, weight = args[0][:T], args[1][:T], args[2][:T]
        cfg0 = moe_plan.named_config(base)
        il = tiled_weights(il_plain, cfg0, tiled)
        wb = weight_bytes(idx, cfg0.BM)
        # rung 0 must be the real kernel: the whole op against the reference first (tests/gpu/test_moe_gemm.py)
        ref = np.asarray(moe_gemm.routed_moe_reference(x, idx, weight, *args[3:], limit=LIMIT))
        got = np.asarray(jax.jit(lambda *z: mt.routed_moe_triton(*z, limit=LIMIT, config=cfg0))(x, idx, weight, *il))
        rel = float(np.linalg.norm(got.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))
        ok = bool(np.all(np.isfinite(got)) and rel < TOL)
        chk = result.setdefault("check", {})[f"{T}:{base}"] = dict(rel_err=rel, tol=TOL, passed=ok)
        outputs[(T, cfg0)] = got
        twin = outputs.get((T, dataclasses.replace(cfg0, tile_major=0))) if cfg0.tile_major else None
        if twin is not None:
            chk["bit_identical_to_plain_il"] = same = bool(np.array_equal(got.view(np.uint16), twin.view(np.uint16)))
            chk["passed"] = ok = ok and same
        print(f"T={T} {base}: rung 0 vs reference rel err {rel:.2e} (tol {TOL}) -> {'ok' if ok else 'FAILED'}"
              + (f" (bit-identical to its plain-il twin: {chk['bit_identical_to_plain_il']})" if twin is not None
                 else "") + f"; {wb['hit_experts']} experts hit, {wb['tiles']} token tiles", flush=True)
        p = jax.jit(lambda x_, i_, w_: moe_plan.prepare(x_, i_, w_, E=E, BM=cfg0.BM, act_fp8=True))(x, idx, weight)
        variants = []           # (rung, pin, fn, launched smem per kernel)
        for r in rungs:
            name = rung_config(base, r)
            if not known_config(name):
                print(f"  {name}: no such named config: rung {r} skipped for {base}")
                continue
            cfg = moe_plan.named_config(name)
            for pin in (("free",) if r == 0 else pins):
                launched = {}
                _PAD.clear()
                for kn in KERNELS:
                    f = table.get(name, {}).get(kn)
                    f0 = table.get(base, {}).get(kn)
                    if not f:
                        continue
                    launched[kn] = f["smem"]
                    if pin == "pinned" and f0 and f["blocks"] > f0["blocks"]:
                        launched[kn] = _PAD[kn] = pin_smem(f["smem"], f0["blocks"])
                if pin == "pinned" and not table.get(name):
                    print(f"  {name}: no sm_90 facts, so nothing to pin to: pinned skipped")
                    continue
                if pin == "pinned" and not _PAD and "free" in pins:
                    print(f"  {name}: programs per SM already <= rung 0's in both kernels: pinned = free, not rerun")
                    continue
                clear_kernel_cache()

                def fn(p_, *w, cfg=cfg, T=T):
                    return mt._launch(p_, *w, T=T, k=TOPK, d=D, I=INTER, E=E, limit=LIMIT, act_fp8=True, cfg=cfg)[0]
                jf = jax.jit(fn)
                jax.block_until_ready(jf(p, *il))          # compile (with the pad) + warm-up
                _PAD.clear()
                clear_kernel_cache()
                variants.append((r, pin, jf, launched))

        def run_all():
            for _r, _pin, jf, _l in variants:
                for _ in range(a.calls):
                    jax.block_until_ready(jf(p, *il))
        print(f"[{time.time() - t_start:.0f} s] T={T}: {len(variants)} variants compiled, tracing", flush=True)
        ev = kernel_durations(run_all, os.path.join("/tmp", f"moe_ladder_trace_{T}_{base}_{os.getpid()}"))
        ups = [d for kn, _, d in ev if kn == KERNELS[0]]
        downs = [d for kn, _, d in ev if kn == KERNELS[1]]
        n = a.calls
        if len(ups) != n * len(variants) or len(downs) != n * len(variants):
            print(f"  trace holds {len(ups)} up / {len(downs)} down launches, expected {n * len(variants)} each: "
                  f"the per-variant split below is unreliable")
        for j, (r, pin, _jf, launched) in enumerate(variants):
            name = rung_config(base, r)
            for kn, durs, nb, nbt in ((KERNELS[0], ups, wb["up"], wb["up_tiles"]),
                                      (KERNELS[1], downs, wb["down"], wb["down_tiles"])):
                nb, nbt = nb * rung_fraction(r, kn), nbt * rung_fraction(r, kn)
                mine = durs[j * n:(j + 1) * n]
                if not mine:
                    continue
                us = float(np.median(mine))
                f = table.get(name, {}).get(kn, {})
                row = dict(T=T, config=name, rung=r, rung_name=PROBES[r], pin=pin, kernel=kn, us=us,
                           us_min=float(min(mine)), us_max=float(max(mine)), weight_bytes=nb,
                           TBps=nb / us / 1e6, tile_TBps=nbt / us / 1e6, frac_of_read=nb / us / 1e6 /
                           result["read_TBps"], regs=f.get("regs"), smem=f.get("smem"),
                           smem_launched=launched.get(kn), loop_sass=f.get("loop_sass"),
                           blocks_per_sm=(blocks_per_sm(f["regs"], f["warps"], launched.get(kn, f["smem"]))
                                          if f else None), rung0_checked=ok)
                rows.append(row)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
        result["rows"] = rows
        if a.out:
            with open(os.path.join(a.out, "moe_ladder.json"), "w") as f:
                json.dump(result, f, indent=1)
    result["wall_s"] = time.time() - t_start
    if a.out:
        with open(os.path.join(a.out, "moe_ladder.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"\nread {result['read_TBps']:.3f} TB/s; checks: "
          + ", ".join(f"{k} {'ok' if v['passed'] else 'FAILED'} ({v['rel_err']:.1e})" for k, v in result["check"].items()))
    print(f"{'T':>4} {'config':<22} {'kernel':<5} {'rung':<17} {'pin':<6} {'prog/SM':>7} {'us':>8} {'TB/s':>6} "
          f"{'of read':>7}")
    for row in rows:
        print(f"{row['T']:>4} {row['config']:<22} {row['kernel'].split('_')[2]:<5} {row['rung']} "
              f"{row['rung_name']:<15} {row['pin']:<6} "
              f"{row['blocks_per_sm'] if row['blocks_per_sm'] is not None else '?':>7} {row['us']:>8.1f} "
              f"{row['TBps']:>6.2f} {100 * row['frac_of_read']:>6.1f}%")
    return result


if __name__ == "__main__":
    main()
