"""Dense FP8 linear configs that are not defaults: candidates for the 64-384-row decode band, timed against
``fp8_linear_triton.DECODE_CONFIG`` by ``scripts/gpu_fp8_linear_sweep.py`` and compiled by
``scripts/sm90_compile_fp8_linear.py``; look names up with ``fp8_linear_triton.named_config(name)``. Nothing on the
default path imports this module.

Why these (session 27; the first four judged on one H100 the same session, benchmarks/results/
fp8_sweep_20261207_h100_s27.json: none beat decode_bn128): at 192 rows ``decode_bn128`` runs 3 row tiles of 64, each
dequantising the whole weight (~16 thread instructions per weight element in all, ~1.8x the issue budget at the read
floor) at 222 registers and 4 warps, so 2 CTAs (8 warps) a SM: few warps to hide the loads' latency. The candidates
separate the causes: more warps a CTA (latency), fewer row tiles (instructions), smaller tiles (occupancy)."""
# Fp8LinearConfig fields by name (the dataclass lives in fp8_linear_triton, which imports this module lazily: kwargs
# here keep the import one-way)
CANDIDATES = {
    # the same tile as decode_bn128 on 8 warps: each warp dequantises half as much, twice the warps in flight
    "dec_bn128_w8": dict(BN=128, warps=8),
    # two row tiles of 128 at 192 rows (one dequantisation less), 8 warps for the [128, 128] fp32 accumulator
    "dec_bn128_bm128_w8": dict(BN=128, BM_MAX=128, warps=8),
    # half the K step with a deeper pipeline: fewer registers a stage, more loads in flight
    "dec_bn128_bk64_s4": dict(BN=128, BK=64, stages=4),
    # run 29's sw_bm256_w8 (H200, 2026-12-02) with BN 128: one row tile (the weight dequantised once)
    "dec_bn128_bm256_w8": dict(BN=128, BM_MAX=256, warps=8),
    # one row tile on one warpgroup with a narrow weight tile: each weight element dequantised once (as bm256_w8)
    # at two CTAs a SM (sm_90 compile, wo_b at 192 rows: 227 registers, 104 KB shared memory, 7.9 thread
    # instructions per weight element in all, against decode_bn128's 16.1); _s4: the same with a fourth stage
    # (140 KB: one CTA a SM). BK 128 with 2 stages spills (255 registers). Written after session 27's sweep.
    "dec_bn64_bm256_bk64": dict(BN=64, BM_MAX=256, BK=64, warps=4, stages=3),
    "dec_bn64_bm256_bk64_s4": dict(BN=64, BM_MAX=256, BK=64, warps=4, stages=4),
    # decode_bn128 with the split-K partials summed by each tile's last program instead of a second launch (session
    # 27's ncu: the reduce launch is 13-24 % of a 192-row op at 6-10 % warps active); bit-identical by construction
    "dec_bn128_lastred": dict(BN=128, reduce="last"),
    # decode_bn128 with the E4M3 bytes decoded by bit placement into even / odd K planes (session 28): ~1.75 thread
    # instructions per weight element for the decode against F2FP + HADD2 + FMUL + F2FP's ~3 (sm_90 compile of
    # decode_bn128's loop: 5.36 per element at 192 rows); two dots of K 64 a step instead of one of 128
    "dec_bn128_planes": dict(BN=128, planes=True),
}
