"""Does the il weight layout's access pattern itself cap the routed-expert kernels near 56 % of DRAM (issue 19)?

Load-only Triton kernels read a routed-expert-sized weight buffer (uint16 halfwords, [E, N, K/4], 4-bit weights) in
the pattern of ``_moe_up_kernel_il`` and in alternatives, add the halfwords into a tiny accumulator (so the loads
stay) and nothing else. There are no dots, no decode and no barriers, so their rate is what the access pattern
allows:

* ``il``: a program owns 64 rows of one expert and steps K by 128 weights: per step 64 rows x 64 contiguous bytes,
  the rows K/2 bytes apart (the il layout as it is);
* ``il256``: the same with 256 weights a step (128 bytes a row: whole cache lines);
* ``blk``: the bytes of each (row block, K step) stored contiguously (4 KB a step), as a blocked il layout would;
* ``flat``: a 1-D stream over the whole buffer (the reference for this kernel style).

torch only (no jax), timed with ``triton.testing.do_bench``. One table. From the repo root on the GPU machine:

  python3 scripts/gpu_moe_stream_probe.py --experts 96 --n 6144 --k 4096

Note (session 30, sm_90 compile): these kernels' loops carry no ``num_stages`` of their own and have no dot, so
Triton does not pipeline them: the weights arrive by plain LDG into registers (``_il_load_kernel`` il: 52 registers,
no shared memory, 9 programs of 4 warps an SM), not by the il kernels' cp.async (LDGSTS) stages.

``--shape up`` / ``--shape down`` (session 30, ladder 2: "meet in the middle" with gpu_moe_ladder.py's rungs 1 / 5-8):
``_pair_load_kernel`` reads the il kernels' exact buffers -- up: W1 and W3 as two [E, I, K/4] halfword buffers (I
2304, K 5120) and their scale words [E, I, K/128]; down: W2 [E, 5120, 2304/4] -- 64 rows x 64 bytes a matrix a step,
every combination of:

* ``--mats`` 2 | 1: both matrices a step (the up kernel) or the first only;
* ``--scales`` none | il | contig: no scale words; one 4-byte word a row a step, rows K/128 words apart (il: 64
  scattered sectors a step a matrix); the same number of 4-byte words from one contiguous run (8 sectors);
* ``--order`` expert | block: programs with the experts fastest (the il launch at one token tile an expert: tiles on
  program_id 0) or an expert's row blocks fastest (the session-14 probe's order);
* ``--pipe`` plain | free | pinned: the loop without num_stages (plain LDG, as the session-14 probe), with the
  launch's num_stages (cp.async stages, as the il kernels: ``--stages``, default 4), and the latter launched with
  its dynamic shared memory padded to ``--pin-blocks`` programs an SM (4: the il kernels' rung 0 at 192 tokens).

  python3 scripts/gpu_moe_stream_probe.py --shape up [--mats 2,1] [--scales none,il,contig] [--order expert,block] \
      [--pipe plain,free,pinned] [--json F]
"""
from __future__ import annotations

import argparse
import json

import triton
import triton.language as tl

SMEM_SM, SMEM_RESERVED, REGS_SM = 233472, 1024, 65536     # sm_90 per SM (as gpu_moe_ladder.py)
SHAPES = {"up": dict(n=2304, k=5120, mats=2), "down": dict(n=5120, k=2304, mats=1)}


@triton.jit
def _il_load_kernel(w_ptr, out_ptr, N: tl.constexpr, KH: tl.constexpr, BN: tl.constexpr, HW: tl.constexpr,
                    BLOCKED: tl.constexpr):
    pid = tl.program_id(0)
    NB: tl.constexpr = N // BN
    e = pid // NB
    nb = pid % NB
    base = w_ptr + e.to(tl.int64) * (N * KH)
    rows = tl.arange(0, BN)
    acc = tl.zeros((BN, HW), tl.uint32)
    for i in tl.range(0, KH // HW):
        if BLOCKED:     # [E, N/BN, KH/HW, BN, HW]: one contiguous BN x HW block per step
            off = (nb * (KH // HW) + i).to(tl.int64) * (BN * HW) + rows[:, None] * HW + tl.arange(0, HW)[None, :]
        else:           # [E, N, KH]: BN rows, HW halfwords of each, rows KH halfwords apart
            off = (nb * BN + rows[:, None]).to(tl.int64) * KH + i * HW + tl.arange(0, HW)[None, :]
        acc += tl.load(base + off).to(tl.uint32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _flat_kernel(w_ptr, out_ptr, n_per_prog: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = w_ptr + pid.to(tl.int64) * n_per_prog
    acc = tl.zeros((BLOCK,), tl.uint32)
    for i in tl.range(0, n_per_prog // BLOCK):
        acc += tl.load(base + i * BLOCK + tl.arange(0, BLOCK)).to(tl.uint32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _pair_load_kernel(w1_ptr, w3_ptr, s1_ptr, s3_ptr, out_ptr, n_steps, NE: tl.constexpr, N: tl.constexpr,
                      KH: tl.constexpr, KW: tl.constexpr, BN: tl.constexpr, MATS: tl.constexpr, SCALES: tl.constexpr,
                      ORDER: tl.constexpr, NSTAGE: tl.constexpr):
    """The il kernels' load stream alone: program (expert, 64-row block), K steps of 128 weights, per step per matrix
    64 rows x 32 halfwords (rows KH halfwords apart) and, SCALES 1, one 4-byte scale word a row (rows KW words apart)
    or, SCALES 2, BN words from one contiguous run (permuted: one 4-byte copy a word, as il); xor-ed into sinks.
    n_steps (= KH / 32) is a run-time argument so that ptxas keeps a loop, as in the il kernels, instead of unrolling
    all the steps of a constant trip count."""
    pid = tl.program_id(0)
    NB: tl.constexpr = N // BN
    if ORDER == 1:      # experts fastest
        e = pid % NE
        nb = pid // NE
    else:               # an expert's row blocks fastest
        e = pid // NB
        nb = pid % NB
    e64 = e.to(tl.int64)
    wb1 = w1_ptr + e64 * (N * KH)
    wb3 = w3_ptr + e64 * (N * KH)
    sb1 = s1_ptr + e64 * (N * KW)
    sb3 = s3_ptr + e64 * (N * KW)
    r = tl.arange(0, BN)
    rows = nb * BN + r
    perm = (r & 7) | (((r >> 5) & 1) << 3) | (((r >> 3) & 3) << 4)      # moe_layout_kernels._il_rows' order
    sk = tl.zeros((BN, 32), tl.int16)
    ss = tl.zeros((BN,), tl.int32)
    for i in tl.range(0, n_steps, num_stages=NSTAGE):
        off = rows[:, None] * KH + i * 32 + tl.arange(0, 32)[None, :]
        sk = sk ^ tl.load(wb1 + off)
        if MATS == 2:
            sk = sk ^ tl.load(wb3 + off)
        if SCALES == 1:
            ss = ss ^ tl.load(sb1 + rows * KW + i)
            if MATS == 2:
                ss = ss ^ tl.load(sb3 + rows * KW + i)
        elif SCALES == 2:
            ss = ss ^ tl.load(sb1 + (nb * KW + i) * BN + perm)
            if MATS == 2:
                ss = ss ^ tl.load(sb3 + (nb * KW + i) * BN + perm)
    v = tl.xor_sum(sk.to(tl.int32), axis=1) ^ ss
    tl.store(out_ptr + pid * BN + r, v)


def blocks_per_sm(regs, warps, smem):
    """Programs per SM on sm_90 (gpu_moe_ladder.blocks_per_sm's rule)."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = REGS_SM // max(per_warp * warps, 1)
    by_smem = SMEM_SM // (smem + SMEM_RESERVED) if smem else 32
    return max(0, min(by_regs, by_smem, 32, 64 // warps))


def pad_shared(kernel, shared):
    """Make later launches of this compiled kernel (triton's cache holds the object) ask for ``shared`` bytes of
    dynamic shared memory: its occupancy changes, nothing else (gpu_moe_ladder.py pads jax-triton's launches the
    same way). Returns the old metadata for ``restore_shared``."""
    from triton.compiler.compiler import make_backend
    old = kernel.metadata
    if shared > old.shared:
        kernel.metadata = old._replace(shared=int(shared))
        kernel.packed_metadata = make_backend(kernel.metadata.target).pack_metadata(kernel.metadata)
        kernel.module = kernel.function = kernel._run = None     # reloaded: sets the dynamic shared memory limit
    return old


def restore_shared(kernel, old):
    from triton.compiler.compiler import make_backend
    if kernel.metadata is not old:
        kernel.metadata = old
        kernel.packed_metadata = make_backend(old.target).pack_metadata(old)
        kernel.module = kernel.function = kernel._run = None


def run_pairs(a):
    """--shape up / down: every (mats, scales, order, pipe) combination of ``_pair_load_kernel``."""
    import torch
    sh = SHAPES[a.shape]
    E, N, K = a.experts, sh["n"], sh["k"]
    KH, KW, BN = K // 4, K // 128, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    w = [torch.randint(-(1 << 15), 1 << 15, (E, N, KH), dtype=torch.int16, device="cuda", generator=g)
         for _ in range(2)]
    sc = [torch.randint(0, 1 << 30, (E, N, KW), dtype=torch.int32, device="cuda", generator=g) for _ in range(2)]
    grid = (E * (N // BN),)
    out = torch.empty(grid[0] * BN, dtype=torch.int32, device="cuda")
    print(f"{a.shape}: {E} experts x {N} rows x K {K}: {w[0].numel() * 2 / 1e9:.2f} GB weights + "
          f"{sc[0].numel() * 4 / 1e9:.3f} GB scale words a matrix; {grid[0]} programs", flush=True)
    rows = []
    st = int((a.stages or "4").split(",")[0])
    for mats in [int(v) for v in a.mats.split(",")]:
        if mats > sh["mats"]:
            continue
        for scales in a.scales.split(","):
            sv = {"none": 0, "il": 1, "contig": 2}[scales]
            nbytes = mats * (w[0].numel() * 2 + (sc[0].numel() * 4 if sv else 0))
            for order in a.order.split(","):
                ov = {"block": 0, "expert": 1}[order]
                for pipe in a.pipe.split(","):
                    nst = None if pipe == "plain" else st

                    def launch(nst=nst, sv=sv, ov=ov, mats=mats):
                        return _pair_load_kernel[grid](w[0], w[1], sc[0], sc[1], out, KH // 32, E, N, KH, KW, BN,
                                                       mats, sv, ov, nst, num_warps=4, num_stages=st)
                    k = launch()
                    torch.cuda.synchronize()
                    old = None
                    if pipe == "pinned":
                        old = pad_shared(k, SMEM_SM // a.pin_blocks - SMEM_RESERVED)
                        launch()
                        torch.cuda.synchronize()
                    try:
                        ms = triton.testing.do_bench(launch, warmup=5, rep=a.rep_ms)
                    finally:
                        smem_launched = k.metadata.shared
                        if old is not None:
                            restore_shared(k, old)
                    r = dict(shape=a.shape, mats=mats, scales=scales, order=order, pipe=pipe, stages=nst,
                             regs=k.n_regs, smem=old.shared if old is not None else k.metadata.shared,
                             smem_launched=smem_launched,
                             blocks_per_sm=blocks_per_sm(k.n_regs, 4, smem_launched), bytes=nbytes, ms=ms,
                             TBps=nbytes / ms / 1e9)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    print(f"\n{'mats':>4} {'scales':<7} {'order':<7} {'pipe':<7} {'regs':>4} {'smem':>6} {'prog/SM':>7} {'ms':>7} "
          f"{'TB/s':>6}")
    for r in rows:
        print(f"{r['mats']:>4} {r['scales']:<7} {r['order']:<7} {r['pipe']:<7} {r['regs']:>4} {r['smem_launched']:>6} "
              f"{r['blocks_per_sm']:>7} {r['ms']:>7.3f} {r['TBps']:>6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": a.shape, "rows": rows}, f, indent=1)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=96)
    ap.add_argument("--n", type=int, default=6144, help="rows of one expert's matrix (gate + up of the up kernel)")
    ap.add_argument("--k", type=int, default=4096, help="weights a row (K)")
    ap.add_argument("--stages", default=None, help="probe shape: 2,3,4,6; up / down: 4 (the first value)")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--json", default="")
    ap.add_argument("--shape", default="probe", choices=("probe", "up", "down"),
                    help="probe: the session-14 variants (above); up / down: the il kernels' buffers "
                         "(_pair_load_kernel)")
    ap.add_argument("--mats", default="2,1")
    ap.add_argument("--scales", default="none,il,contig")
    ap.add_argument("--order", default="expert,block")
    ap.add_argument("--pipe", default="plain,free,pinned")
    ap.add_argument("--pin-blocks", type=int, default=4)
    ap.add_argument("--rep-ms", type=int, default=50)
    a = ap.parse_args()
    if a.shape != "probe":
        return run_pairs(a)
    import torch
    a.stages = a.stages or "2,3,4,6"
    E, N, KH = a.experts, a.n, a.k // 4
    w = torch.randint(0, 1 << 15, (E, N, KH), dtype=torch.int16, device="cuda")
    nbytes = w.numel() * 2
    BN = 64
    out = torch.empty(E * (N // BN), dtype=torch.int32, device="cuda")
    rows = []
    print(f"buffer {nbytes / 1e9:.2f} GB ({E} experts x {N} x {a.k} 4-bit weights)", flush=True)

    def timed(name, fn, **cfg):
        ms = triton.testing.do_bench(fn, warmup=5, rep=50)
        r = {"variant": name, **cfg, "ms": ms, "TBps": nbytes / ms / 1e9}
        rows.append(r)
        print(json.dumps(r), flush=True)

    for warps in [int(v) for v in a.warps.split(",")]:
        for st in [int(v) for v in a.stages.split(",")]:
            for name, hw, blk in (("il", 32, False), ("il256", 64, False), ("blk", 32, True)):
                grid = (E * (N // BN),)
                timed(name, lambda hw=hw, blk=blk: _il_load_kernel[grid](w, out, N, KH, BN, hw, blk,
                                                                        num_warps=warps, num_stages=st),
                      warps=warps, stages=st)
            per = 1 << 20                    # halfwords a program
            nprog = w.numel() // per
            timed("flat", lambda: _flat_kernel[(nprog,)](w, out, per, 4096, num_warps=warps, num_stages=st),
                  warps=warps, stages=st)
    print("\nvariant  warps stages      ms    TB/s")
    for r in rows:
        print(f"{r['variant']:<8} {r['warps']:>5} {r['stages']:>6} {r['ms']:>7.3f} {r['TBps']:>7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "bytes": nbytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
