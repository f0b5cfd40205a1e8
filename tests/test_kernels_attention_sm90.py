"""CPU-host sm_90 compile of the flash sparse-attention kernel (scripts/sm90_compile.py: triton's bundled ptxas /
nvdisasm, no GPU): RoPE on the 64-channel tails (``_flash_kernel``'s RD, session 21, kernels/NOTES.md) leaves the
main loop as it is but for a rematerialised thread index (1,169 SASS a warp against 1,165 with triton 3.6.0: S2R,
SHF, LOP3, NOP), with the same MMA, copy and shared-memory instructions and no local-memory traffic. Its first form --
the whole [64, 512] q tile rotated in registers -- made Triton keep q as a register wgmma operand: a loop of 1,407
SASS, with spills. Skipped where triton is not installed."""
import os
import sys

import pytest

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import sm90_compile  # noqa: E402

from dsflash.kernels import sparse_attention_triton as sat  # noqa: E402

SIG = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", sink_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32",
           o_ptr="*bf16")
# V4.1 prefill: 64 heads x 512, K = 640 entries in 10 blocks of 64, one split (flash_bk64: 8 warps, 3 stages)
CONSTS = dict(S=4096, N=5000, H=64, D=512, K=640, SCALE=512 ** -0.5, BK=64, BPS=10, HG=64, P_BF16=1, IEEE=0)


def test_rope_tails_leave_the_flash_main_loop_alone():
    cfg = sat.NAMED_CONFIGS["flash_bk64"]
    reps = {rd: sm90_compile.compile_kernel(sat._flash_kernel, SIG, dict(CONSTS, RD=rd, ROUND_O=1),
                                            num_warps=cfg.warps, num_stages=cfg.stages) for rd in (0, 64)}
    base, rope = reps[0].main_loop, reps[64].main_loop
    assert base is not None and rope is not None
    assert base.n <= rope.n <= base.n + 8, (base.n, rope.n, (rope.ops - base.ops).most_common(8))
    for op in ("HGMMA", "LDGSTS", "LDS", "LDSM", "STS", "WARPGROUP", "BAR"):
        assert rope.ops[op] == base.ops[op], (op, base.ops[op], rope.ops[op])
    assert rope.ops["HGMMA"] > 0 and rope.ops["STL"] == 0 and rope.ops["LDL"] == 0
    assert reps[64].smem == reps[0].smem
