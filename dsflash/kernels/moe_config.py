"""The MoE grouped-GEMM kernel config type, shared by ``moe_plan`` (the defaults, ``named_config``) and
``experimental/moe_configs.py`` (the variants), so that neither imports the other at import time."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    BM: int = 16          # token rows per tile (never crosses an expert)
    BN_UP: int = 64       # columns of I per program in the gate/up kernel (multiple of 32)
    BN_DOWN: int = 64     # columns of d per program in the down kernel
    KSUB: int = 4         # 32-wide K blocks per loop iteration
    warps_up: int = 4
    warps_down: int = 4
    stages: int = 4
    decode: str = "asm"   # "asm" | "tl" (kind "fp8mma" only)
    kind: str = "fp8mma"  # "fp8mma": E2M1 -> E4M3 bytes, FP8 MMA per 32-wide K block, fp32 rescale per block
                          # "ds": tl.dot_scaled (Hopper: upcast to bf16 with scales, bf16 MMA over BK)
    BK: int = 128         # K chunk of the "ds" kernels (multiple of 32 dividing d and I)
    act: str = "fp8"      # "ds" + reference precision: "fp8" = E4M3 codes + UE8M0 scales into dot_scaled;
                          # "bf16rt" = bf16 carriers of the same round-tripped values (exact), bf16 lhs
    # kind "sk" (split-K decode kernels, experimental/moe_families._moe_*_kernel_sk):
    mma: str = "bf16"     # "bf16": BK-wide weight slab (16-byte loads) decoded to bf16 with its scales applied
                          # (exact), next slab prefetched into registers, one bf16 MMA per slab, bf16 carriers of
                          # the FP8 round trips; "fp8": the fp8mma per-32 block loop (KSUB blocks per step);
                          # "gemv": BM=1 tiles on the CUDA cores (slab + prefetch as "bf16", no MMA)
                          # "swap": as "bf16" with the weights as the MMA's left operand (acc^T = W . x^T; Hopper
                          # wgmma reads it from registers); "swap_eo": "swap" without the nibble interleave (even
                          # and odd K elements as two planes, two MMAs per slab); "swap_bd": "swap_eo" with the
                          # planes built as bf16 bits directly (inline PTX, bf16x2 scale multiplies, no fp32);
                          # "swap_ps": swapped, raw codes in fp16 MMAs per 32-wide K group, scales applied to
                          # the fp32 partials (FP8 activations only; h as FP8 codes + scales)
    prefetch: bool = True # mma "swap" / "swap_eo": next slab loaded into registers by hand (else Triton's pipeliner)
    n_fast: bool = False  # mma "swap_il": launch the column blocks fastest (grid (N blocks, M tiles, K splits)), so
                          # the programs in flight share a few token tiles (x / h read once from DRAM, L2 across the
                          # column blocks) instead of every tile of one column block (all of x / h streamed again
                          # for each of the I / 64 or d / 64 column blocks). Same programs, same math: bit-identical
    group_m: int = 1      # with n_fast: groups of group_m M tiles, within a group the tiles fastest, then the column
                          # blocks (Triton's grouped ordering), so the programs in flight also share column blocks:
                          # an expert whose slots span several tiles of a group has its weights read once for them,
                          # not once per tile (1: plain n_fast, column blocks fastest). Same programs: bit-identical
    split_gate_up: bool = False  # mma "swap_il": the gate rows (W1) and the up rows (W3) in separate programs (half
                          # the accumulators and decoded planes each, for more programs per SM); their fp32 sums meet
                          # in the split-K epilogue kernel, which applies SwiGLU exactly as the joint kernel does
    plane_h: bool = False # mma "swap_il", KS_UP 1, joint gate / up: h stored with each 128-wide K slab as its 64 even
                          # then 64 odd elements, so the down kernel's wgmma B planes load straight into shared memory
                          # (no in-register even / odd split + store back per column block). Same operands, same
                          # dots: o bit-identical; h is un-permuted when returned as an intermediate
    plane_x: bool = False # mma "swap_il", act "bf16rt": x dequantised once (or, at precision "bf16", taken as it is)
                          # into plane order (each 128-wide K slab as its 64 even then 64 odd elements), so the up
                          # kernel's wgmma B planes load straight into shared memory (no in-register even / odd split
                          # + store back per column block, which also spilled at BM 128). Same dots: bit-identical
    down_pair: bool = False  # mma "swap_il" with plane_h: each down program computes two adjacent column blocks (2 x
                          # BN_DOWN rows of W2) from one read of its h slab, halving h's L2 traffic (each h tile is
                          # read once per program: d / BN_DOWN times without it). Same dots per column: bit-identical
    tile_major: int = 0   # mma "swap_il" only (session 28, revived in session 30; experimental, NOT RUN ON A GPU):
                          # the weights are permuted by ``moe_layout.to_tiles(level=tile_major)`` so that a program's
                          # weight bytes of one K step are one contiguous 4 KB tile instead of 64 pieces of 64 B (one
                          # run instead of 64 row streams); 1: the tile's 64 scale words one 256-byte run, rows in
                          # memory order (read in the kernel's permuted row order: 64 separate 4-byte copies); 2: the
                          # same run with the words in the kernel's load order (addresses contiguous a warp; the
                          # sm_90 compile still makes one 4-byte copy a word, as at level 1: 64 words over 128
                          # threads, and level 1's permuted order touches the same 4 sectors a warp). The caller
                          # must pass tiled weights of that level (nothing in their shape or dtype tells). Same dots:
                          # bit-identical
    stages_down: int = 0  # num_stages of the down launch (0: ``stages``); plane_h's down loop fits 3 programs per SM
                          # at 2 stages while its up kernel spills there
    probe: int = 0        # mma "swap_il" only, timing probes (session 29's decode ladder; outputs are GARBAGE):
                          # 0 the kernels; 1-4 the il kernels' loop with pieces taken out -- 1 weight + scale loads
                          # only, 2 + the weight decode, 3 loads + x / h slab + MMA on the raw bits (no decode), 4
                          # loads + decode + x / h slab (no MMA); moe_layout_kernels "the decode ladder"; 5-8 rung
                          # 1's load stream varied (session 30's ladder 2: no scales / contiguous scale words / W1
                          # only / one matrix a program, 8 with split_gate_up)
    KS_UP: int = 0        # K splits of the gate/up GEMM (0: auto, split_k()); partial sums go through fp32
    KS_DOWN: int = 0      # K splits of the down GEMM (0: auto)
    min_programs: int = 1056   # auto split-K target: programs per launch (132 SMs x 8)
