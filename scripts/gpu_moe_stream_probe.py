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
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=96)
    ap.add_argument("--n", type=int, default=6144, help="rows of one expert's matrix (gate + up of the up kernel)")
    ap.add_argument("--k", type=int, default=4096, help="weights a row (K)")
    ap.add_argument("--stages", default="2,3,4,6")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
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
