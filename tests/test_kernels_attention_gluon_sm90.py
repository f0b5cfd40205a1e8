"""CPU-host sm_90 compile of the Gluon prefill flash kernel (``kernels/sparse_attention_gluon.py``;
scripts/sm90_compile.py, triton's bundled ptxas / nvdisasm, no GPU), against the Triton ``_flash_kernel`` at the same
prefill shape: the point of the Gluon kernel is that each warpgroup computes only its half of S, so its main loop
issues half of Triton's QK instructions (32 HGMMA.64x32 a warp a block, each warpgroup its own 32 entries), without
spills and in
one CTA's shared memory. Triton's loop issues 64 + 4: both warpgroups compute the whole [64, 64] S as two n32 halves
(sm_90 compile with triton 3.6.0: 68 HGMMA in a 1,127-instruction loop against the Gluon kernel's 36 in 686). Skipped where triton (with Gluon) is not installed."""
import os
import re
import sys

import pytest

pytest.importorskip("triton.experimental.gluon")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import sm90_compile  # noqa: E402

from dsflash.kernels import sparse_attention_triton as sat  # noqa: E402
from dsflash.kernels import sparse_attention_gluon as sag  # noqa: E402

SIG = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", sink_ptr="*fp32", S="i32", N="i32", K="i32", o_ptr="*bf16")


def _hgmma_widths(sass):
    """N of each HGMMA in the SASS (``HGMMA.64x<N>x16``)."""
    return [int(n) for n in re.findall(r"HGMMA\.64x(\d+)x16", sass)]


@pytest.mark.parametrize("overlap", [0, 1])
def test_gluon_flash_computes_each_block_of_s_once(overlap):
    rep = sm90_compile.compile_kernel(sag.flash_gluon_kernel, SIG, dict(H=64, D=512, SCALE=512 ** -0.5, BK=64, NB=10,
                                                                         OVERLAP=overlap), num_warps=8)
    assert rep.spill_stores == 0 and rep.spill_loads == 0
    assert rep.smem <= 227 * 1024
    loop = rep.main_loop
    assert loop is not None and loop.ops["HGMMA"] == 36          # QK 512 / 16 = 32 steps + PV 64 / 16 = 4
    widths = _hgmma_widths(rep.sass)
    assert set(widths) == {32, 256}, set(widths)                  # QK: 32 entries a warpgroup; PV: 256 channels

    cfg = sat.NAMED_CONFIGS["flash_bk64_s2"]
    tri = sm90_compile.compile_kernel(
        sat._flash_kernel, dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", sink_ptr="*fp32", cos_ptr="*fp32",
                                sin_ptr="*fp32", o_ptr="*bf16"),
        dict(S=4096, N=5000, H=64, D=512, K=640, SCALE=512 ** -0.5, BK=64, BPS=10, HG=64, P_BF16=1, IEEE=0),
        num_warps=cfg.warps, num_stages=cfg.stages)
    assert tri.main_loop.ops["HGMMA"] == 64 + 4                  # Triton's QK: the whole block in each warpgroup
    assert loop.n < tri.main_loop.n, (loop.n, tri.main_loop.n)


def test_one_block_launches_are_padded_to_two():
    """A one-block launch (K <= 64) stops Triton 3.6's lowering with an assertion (sm_90 compile, session 25; the GPU
    test's K = 40 case failed so): ``pad_entries`` gives such an idx a second block of empty (-1) entries, which add
    nothing, and leaves longer ones alone."""
    import jax.numpy as jnp
    import numpy as np
    idx = jnp.arange(2 * 3 * 40, dtype=jnp.int32).reshape(2, 3, 40)
    out = np.asarray(sag.pad_entries(idx))
    assert out.shape == (2, 3, 2 * sag.BK)
    np.testing.assert_array_equal(out[..., :40], np.asarray(idx))
    assert (out[..., 40:] == -1).all()
    long = jnp.zeros((1, 2, sag.BK + 1), jnp.int32)
    assert sag.pad_entries(long) is long


def test_channel_split_kernel_fits_one_cta_and_runs_qk_at_n64():
    """The warp-specialised channel-split kernel (``sparse_attention_gluon_ws``): both partitions' main loops issue
    16 QK HGMMA at n64 (each warpgroup its 256 channels of the whole block) and 4 PV HGMMA at n256, P from registers
    (no shared-memory P), no spills, inside the 227 KB of one CTA."""
    from dsflash.kernels.experimental import sparse_attention_gluon_ws as ws
    rep = sm90_compile.compile_kernel(ws.flash_ws_kernel, SIG, dict(H=64, D=512, SCALE=512 ** -0.5, BK=64, NB=10,
                                                                     WORKER_REGS=232), num_warps=4)
    assert rep.spill_stores == 0 and rep.spill_loads == 0
    assert rep.smem <= 227 * 1024
    assert rep.main_loop is not None and rep.main_loop.ops["HGMMA"] == 16 + 4
    assert set(_hgmma_widths(rep.sass)) == {64, 256}
    pv = re.findall(r"HGMMA\.64x256x16\.F32\.BF16 R\d+, (\S+),", rep.sass)
    assert pv and all(a.startswith("R") for a in pv), pv[:4]         # PV's A operand (P) in registers
