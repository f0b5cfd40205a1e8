"""Dequantisation of the loaded stored formats against an independent decoder written here in plain
Python bit arithmetic (no ml_dtypes, no dsflash.quant):

* E4M3: sign, 4-bit exponent (bias 7), 3-bit mantissa, subnormals at exponent 0, S.1111.111 = NaN.
* E2M1: codes 0..7 = {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 = sign; two per byte, low nibble first.
* UE8M0: byte b = 2^(b - 127).
Dense FP8 weights use one scale per 32x32 block; MXFP4 experts one scale per 32 along K; Engram rows
one scale per 32 along the row.
"""
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.checkpoint import SafetensorsFile, load_checkpoint, read_weight_map
from dsflash.checkpoint.synth import random_stored_params, write_synthetic_checkpoint
from dsflash.config import preset
from dsflash import quant


# ----------------------------------------------------------------------------- independent decoder
def e4m3(b: int) -> float:
    sign = -1.0 if b & 0x80 else 1.0
    exp, man = (b >> 3) & 0xF, b & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0 ** -9          # (man/8) * 2^(1-7)
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


def e2m1(c: int) -> float:
    mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][c & 0x7]
    return -mag if c & 0x8 else mag


def ue8m0(b: int) -> float:
    return math.nan if b == 255 else 2.0 ** (b - 127)


E4M3_LUT = np.array([e4m3(b) for b in range(256)], np.float64)
E2M1_LUT = np.array([e2m1(c) for c in range(16)], np.float64)
UE8M0_LUT = np.array([ue8m0(b) for b in range(256)], np.float64)


def raw_bytes(a) -> np.ndarray:
    a = np.asarray(a)
    assert a.dtype.itemsize == 1
    return a.view(np.uint8)


def ref_fp8_block(w, s) -> np.ndarray:
    """Dense FP8 [.., out, in] with UE8M0 per 32x32 block [.., out/32, in/32]."""
    vals = E4M3_LUT[raw_bytes(w)]
    sc = UE8M0_LUT[raw_bytes(s)]
    rows = np.arange(vals.shape[-2]) // 32
    cols = np.arange(vals.shape[-1]) // 32
    return vals * sc[..., rows[:, None], cols[None, :]]


def ref_fp8_rows(w, s) -> np.ndarray:
    """Engram rows: FP8 [R, D] with UE8M0 per 32 along the row [R, D/32]."""
    vals = E4M3_LUT[raw_bytes(w)]
    return vals * UE8M0_LUT[raw_bytes(s)][:, np.arange(vals.shape[-1]) // 32]


def ref_mxfp4(packed, s) -> np.ndarray:
    """MXFP4 [.., out, in/2] int8 (element 2k = low nibble) with UE8M0 per 32 along K [.., out, in/32]."""
    u = raw_bytes(packed).astype(np.int64)
    lo, hi = u & 0xF, u >> 4
    codes = np.empty(u.shape[:-1] + (u.shape[-1] * 2,), np.int64)
    codes[..., 0::2] = lo
    codes[..., 1::2] = hi
    vals = E2M1_LUT[codes]
    return vals * UE8M0_LUT[raw_bytes(s)][..., np.arange(vals.shape[-1]) // 32]


def assert_same(got, want, what):
    got = np.asarray(got, np.float64)
    want = want.astype(np.float32).astype(np.float64)   # the decoders return f32
    assert got.shape == want.shape, what
    bad = ~((got == want) | (np.isnan(got) & np.isnan(want)))
    assert not bad.any(), f"{what}: {bad.sum()} elements differ, first at {np.argwhere(bad)[0]}"


# ----------------------------------------------------------------------------- exhaustive code tables
def test_all_e4m3_codes():
    """Every byte, and a sweep of block scales, through dequant_fp8_weight."""
    codes = np.tile(np.arange(256, dtype=np.uint8), (32, 1))              # [32, 256]: 8 blocks of 32x32
    w = jnp.asarray(codes.view(jnp.float8_e4m3fn))
    for sb in (127, 120, 130, 100, 150):
        s = np.full((1, 8), sb, np.uint8)
        s[0, 3] = sb + 1                                                   # a different scale in one block
        assert_same(quant.dequant_fp8_weight(w, jnp.asarray(s)), ref_fp8_block(codes, s), f"scale {sb}")
    # sanity of the independent table itself: a few known values
    assert E4M3_LUT[0x7E] == 448.0 and E4M3_LUT[0x01] == 2.0 ** -9 and E4M3_LUT[0x08] == 2.0 ** -6
    assert E4M3_LUT[0x38] == 1.0 and E4M3_LUT[0xB8] == -1.0 and np.isnan(E4M3_LUT[0x7F])


def test_all_e2m1_bytes():
    packed = np.tile(np.arange(256, dtype=np.uint8), (4, 1))               # [4, 256] -> 512 values, 16 blocks
    s = (np.arange(4 * 16, dtype=np.uint8).reshape(4, 16) % 9 + 123)
    got = quant.dequant_mxfp4_weight(jnp.asarray(packed.view(np.int8)), jnp.asarray(s))
    assert_same(got, ref_mxfp4(packed, s), "all bytes")
    # byte 0x21 = low nibble 1 (0.5) first, high nibble 2 (1.0) second
    assert list(ref_mxfp4(np.array([[0x21] * 16], np.uint8), np.full((1, 1), 127, np.uint8))[0, :2]) == [0.5, 1.0]


def test_ue8m0_scales():
    b = np.arange(0, 255, dtype=np.uint8)          # 0 = 2^-127 (subnormal in f32); 255 (NaN) is never stored
    got = np.asarray(quant.e8m0_to_f32(jnp.asarray(b)), np.float64)
    assert np.array_equal(got, UE8M0_LUT[b])


# ----------------------------------------------------------------------------- the loaded checkpoint
@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    cfg = preset("tiny")
    # random stored bytes: every FP8 code (NaN aside) and every nibble pair occurs in the big tensors
    params = random_stored_params(cfg, seed=3)
    folder = write_synthetic_checkpoint(tmp_path_factory.mktemp("q"), cfg, params=params, tokenizer=False)
    cfg, params = load_checkpoint(folder, progress=False)
    return folder, cfg, params


FP8_WEIGHTS = ["layers.0.attn.wq_a", "layers.2.attn.wq_b", "layers.4.attn.wkv", "layers.5.attn.wo_a",
               "layers.7.attn.wo_b", "layers.3.ffn.shared_experts.w2", "layers.1.engram.wkv",
               "layers.7.attn.indexer.wq_b", "mtp.0.main_proj", "mtp.0.ffn.shared_experts.w1"]


@pytest.mark.parametrize("name", FP8_WEIGHTS)
def test_fp8_weights(loaded, name):
    _, _, p = loaded
    w, s = p[f"{name}.weight"], p[f"{name}.scale"]
    assert w.dtype == jnp.float8_e4m3fn and s.dtype == jnp.uint8
    assert_same(quant.dequant_fp8_weight(w, s), ref_fp8_block(w, s), name)
    assert np.isfinite(np.asarray(quant.dequant_fp8_weight(w, s))).all()
    assert len(np.unique(raw_bytes(w))) == 254 or w.size < 4096   # all non-NaN codes exercised


@pytest.mark.parametrize("name", ["layers.0.ffn.experts.w1", "layers.3.ffn.experts.w2", "layers.7.ffn.experts.w3",
                                  "mtp.0.ffn.experts.w2"])
def test_mxfp4_experts(loaded, name):
    """Stacked loaded experts dequantise element-wise like each per-expert tensor of the shard file."""
    folder, cfg, p = loaded
    w, s = p[f"{name}.weight"], p[f"{name}.scale"]
    assert w.dtype == jnp.int8 and s.dtype == jnp.uint8
    got = np.asarray(quant.dequant_mxfp4_weight(w, s))
    wm = read_weight_map(folder)
    block, wi = name.rsplit(".", 1)
    for e in range(w.shape[0]):
        wn, sn = f"{block}.{e}.{wi}.weight", f"{block}.{e}.{wi}.scale"
        fw = SafetensorsFile(os.path.join(folder, wm[wn])).get(wn)
        fs = SafetensorsFile(os.path.join(folder, wm[sn])).get(sn)
        assert_same(got[e], ref_mxfp4(fw, fs), f"{name} expert {e}")
    assert got.shape[-1] == 2 * w.shape[-1]


def test_engram_rows(loaded):
    _, _, p = loaded
    w, s = p["layers.1.engram.embed.weight"], p["layers.1.engram.embed.scale"]
    got = quant.fp8_dequant(w, quant.e8m0_to_f32(s), 32)
    assert_same(got, ref_fp8_rows(w, s), "engram table")
