"""The load-time MoE weight layout "il" (``dsflash.kernels.moe_layout``; the kernels are
``kernels/experimental/moe_layout_kernels.py``, checked in Triton's interpreter by ``scripts/triton_interpret_moe.py
--only il`` and on the sm_90 compile by tests/test_kernels_moe_sm90.py): the repack is a pure, invertible map whose
decode -- the host model of the kernel's bit operations, and an instruction-by-instruction emulation of the kernel's
inline PTX -- equals the reference dequantisation; planted mistakes (a wrong nibble order, a wrong shift in the PTX)
are caught; the front end and the model accept weights in the layout with bit-identical outputs."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsflash import quant
from dsflash.kernels import moe_gemm, moe_layout as L, moe_plan


def _weights(key, shape, lo=100, hi=L.MAX_SCALE):
    """Random packed bytes [..., N, K/2] (every byte a valid nibble pair) and scales in [lo, hi]."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(key))
    *lead, n, K = shape
    w = jax.random.randint(k1, (*lead, n, K // 2), -128, 128, jnp.int32).astype(jnp.int8)
    s = jax.random.randint(k2, (*lead, n, K // 32), lo, hi + 1, jnp.int32).astype(jnp.uint8)
    return w, s


def test_round_trip_and_shapes():
    w, s = _weights(0, (3, 64, 512))
    s = s.at[0, 0, 0].set(0).at[1, 2, 3].set(L.MAX_SCALE)
    wh, sw = L.repack(w, s)
    assert wh.dtype == jnp.uint16 and wh.shape == (3, 64, 128) and sw.dtype == jnp.uint32 and sw.shape == (3, 64, 4)
    assert L.is_il(wh) and not L.is_il(w)
    w2, s2 = L.to_checkpoint(wh, sw)
    np.testing.assert_array_equal(np.asarray(w2), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(s))
    wj, sj = jax.jit(L.repack)(w, s)                            # pure and jit-able
    np.testing.assert_array_equal(np.asarray(wj), np.asarray(wh))
    np.testing.assert_array_equal(np.asarray(sj), np.asarray(sw))


def test_every_byte_at_every_position_decodes_to_the_reference():
    # row r, byte column j holds byte (r * 64 + j) % 256 (K = 256): all 256 bytes at each of the 128 columns mod 64
    n, K = 256, 256
    b = ((np.arange(n)[:, None] * 64 + np.arange(K // 2)[None, :]) % 256).astype(np.uint8)
    w = jnp.asarray(b.view(np.int8))
    # (scale 1 is left out: its 0.5 * 2^-126 is a subnormal the layout's decode keeps and XLA's CPU reference flushes)
    s = jnp.asarray(np.tile(np.array([2, 60, 127, 128, 0, 119, 122, 100], np.uint8), (n, 1)))
    ref = np.asarray(quant.dequant_mxfp4_weight(w, s))
    np.testing.assert_array_equal(L.decode(*L.repack(w, s)), ref)


def test_decode_matches_reference_on_random_weights():
    w, s = _weights(1, (2, 128, 1024), lo=2)
    np.testing.assert_array_equal(L.decode(*L.repack(w, s)), np.asarray(quant.dequant_mxfp4_weight(w, s)))


def test_a_wrong_nibble_order_is_caught():
    w, s = _weights(2, (64, 256))
    ref = np.asarray(quant.dequant_mxfp4_weight(w, s))
    src = L.SRC
    for mutant in ((src[2], src[3], src[0], src[1]),            # even / odd plane swapped (nibbles of a byte)
                   (src[1], src[0], src[2], src[3]),            # h halves swapped
                   (src[0], src[1], src[2], (11, 10, 13, 14))):  # two bits of one nibble swapped
        assert not np.array_equal(L.decode(*L.repack(w, s, src=mutant)), ref), mutant
        w2, _ = L.to_checkpoint(*L.repack(w, s, src=mutant))
        assert not np.array_equal(np.asarray(w2), np.asarray(w)), mutant


def test_scales_outside_the_domain_are_refused_or_poisoned():
    w, s = _weights(3, (64, 128))
    s = s.at[5, 1].set(L.MAX_SCALE + 1)
    with pytest.raises(ValueError, match="exceed 128"):
        L.check_scales(s)
    with pytest.raises(ValueError, match="exceed 128"):
        L.repack_experts(w, s, w, s, w, s)
    got = L.decode(*L.repack(w, s))                          # unchecked: the group decodes to inf / nan, never a number
    bad = got[5, 32:64]
    assert not np.isfinite(bad).any()
    np.testing.assert_array_equal(np.delete(got, 5, axis=0), np.delete(np.asarray(quant.dequant_mxfp4_weight(w, s)),
                                                                        5, axis=0))
    with pytest.raises(ValueError, match="divisible by 128"):
        L.repack(w[:, :32], s[:, :2])


# ------------------------------------------------------------------ the inline PTX, emulated instruction by instruction
def _bf16_mul(a, b):
    """mul.rn.bf16x2 on uint32 lanes: each 16-bit lane a bf16, the product rounded to nearest even (subnormals kept)."""
    out = np.zeros_like(a)
    for sh in (0, 16):
        x = ((a >> sh) & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        y = ((b >> sh) & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            z = (x * y).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
        out |= z << sh
    return out


def _run_ptx(asm, operands):
    """Emulate the decode's PTX (and / or / shl / shr .b32, mul.rn.bf16x2) on numpy uint32 arrays. ``operands``:
    {"$4": ..., "$5": ...}; returns the registers (incl. $0..$3)."""
    reg = dict(operands)

    def val(t):
        t = t.strip()
        if t in reg:
            return reg[t]
        return np.uint32(int(t, 0))
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        m = re.fullmatch(r"(\S+)\s+(\S+),\s*(\S+),\s*(\S+)", line)
        assert m, line
        op, d, a, b = m.groups()
        if op == "and.b32":
            reg[d] = val(a) & val(b)
        elif op == "or.b32":
            reg[d] = val(a) | val(b)
        elif op == "shl.b32":
            reg[d] = (val(a) << val(b)) & np.uint32(0xFFFFFFFF)
        elif op == "shr.b32":
            reg[d] = val(a) >> val(b)
        elif op == "mul.rn.bf16x2":
            reg[d] = _bf16_mul(val(a), val(b))
        else:
            raise AssertionError(f"unemulated instruction {line!r}")
    return reg


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def _expected_lane(v, s, x):
    """bf16 bits of output x (A..D) for halfword v and UE8M0 scale s, from the layout's bit table alone."""
    code = np.zeros_like(v)
    for role, pos in enumerate(L.SRC[x]):
        code |= ((v >> pos) & 1) << role
    val = E2M1[code] * (0.0 if s == 0 else 2.0 ** (int(s) - 127))
    return val.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)


def _check_ptx(asm):
    v = np.arange(1 << 16, dtype=np.uint32)
    rng = np.random.default_rng(0)
    other = rng.integers(0, 1 << 16, v.size, dtype=np.uint32)
    for s in (0, 1, 2, 60, 100, 119, 120, 121, 122, 123, 124, 127, 128):
        sp = 0 if s == 0 else s + 126                        # the scale byte the repack stores
        f = np.uint32((sp << 7) | (sp << 23))
        for lo, hi, lane in ((v, other, 0), (other, v, 16)):
            reg = _run_ptx(asm, {"$4": lo | (hi << 16), "$5": np.full(v.size, f, np.uint32)})
            for x in range(4):
                got = (reg[f"${x}"] >> lane) & 0xFFFF
                want = _expected_lane(v, s, x)
                if not np.array_equal(got, want):
                    return False
    return True


def test_inline_ptx_emulated_exhaustively():
    assert _check_ptx(L.IL_ASM)


def test_a_wrong_shift_in_the_ptx_is_caught():
    assert "shl.b32 t, $4, 3;" in L.IL_ASM
    assert not _check_ptx(L.IL_ASM.replace("shl.b32 t, $4, 3;", "shl.b32 t, $4, 4;"))
    assert not _check_ptx(L.IL_ASM.replace("shr.b32 u, $4, 5;", "shr.b32 u, $4, 4;"))


# ------------------------------------------------------------------ front end and model
def test_reference_accepts_il_weights_bit_identically():
    x, idx, weight, w1, s1, w3, s3, w2, s2 = moe_plan.random_moe_problem(jax.random.PRNGKey(4), 5, 2, 4, 256, 128)
    ref = jax.jit(lambda *a: moe_gemm.routed_moe_reference(*a, limit=10.0))
    a = ref(x, idx, weight, w1, s1, w3, s3, w2, s2)
    b = ref(x, idx, weight, *L.repack_experts(w1, s1, w3, s3, w2, s2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_il_weights_run_swap_il_at_every_size_with_wider_tiles_for_prefill():
    """il weights never go back to the checkpoint-layout prefill kernel (run 37: converting them back cost ~5 ms
    per layer); the token tile grows with the slots per expert (run 39's measured bands), and above 128 slots per
    expert the column blocks launch fastest (session 17), 8 token tiles to a column block (session 18), and above 64
    slots per expert x and h in plane order with two column blocks per down program (session 19)."""
    name = {id(c): n for n, c in moe_plan.named_configs().items()}
    rows = (6, 96, 768, 1536, 3072, 3073, 6144, 6145, 12288, 12289, 24576)
    picked = {r: name[id(moe_plan.pick_config(r, 96, layout="il"))] for r in rows}
    assert picked == {6: "sw_il", 96: "sw_il", 768: "sw_il", 1536: "sw_il_bm32", 3072: "sw_il_bm32",
                      3073: "sw_il_bm64_xb", 6144: "sw_il_bm64_xb", 6145: "sw_il_bm128_nf_g8_hp_xp_dp",
                      12288: "sw_il_bm128_nf_g8_hp_xp_dp", 12289: "sw_il_bm128_nf_g8_hp_xp_dp",
                      24576: "sw_il_bm128_nf_g8_hp_xp_dp"}
    assert all(moe_plan.pick_config(r, 96, layout="il").mma == "swap_il" for r in (1, 10 ** 6))
    assert moe_plan.pick_config(96, 96) == moe_plan.DECODE_SMALL_CONFIG          # the default is unchanged
    assert moe_plan.pick_config(1152, 96) == moe_plan.DECODE_CONFIG
    assert moe_plan.pick_config(96 * 33, 96) == moe_plan.PREFILL_CONFIG
    cfg = moe_plan.named_config("sw_il")
    assert (cfg.kind, cfg.mma, cfg.BM, cfg.BN_UP, cfg.BN_DOWN, cfg.BK) == ("sk", "swap_il", 16, 64, 64, L.BK)


def test_demo_model_moe_with_il_weights_is_bit_identical():
    """``moe_il_weights`` repacks exactly the routed experts' arrays of the demo model, and the model's MoE block gives
    bit-identical outputs on them (the XLA path converts them back)."""
    import dsflash
    from dsflash.model import moe as moe_block
    from dsflash.model.params import moe_il_weights, spec_map
    m = dsflash.load("demo", progress=False)
    il = moe_il_weights(m.cfg, m.params)
    specs = spec_map(m.cfg)
    changed = [n for n in m.params if il[n] is not m.params[n]]
    assert changed and all(".experts." in n and specs[n].fmt in ("mxfp4", "scale") for n in changed)
    assert all(L.is_il(il[n]) for n in changed if n.endswith(".weight"))
    assert len(changed) == 2 * sum(1 for n in m.params if n.endswith(".experts.w1.weight")) * 3
    prefix = changed[0].split(".experts.")[0]
    x = jax.random.normal(jax.random.PRNGKey(5), (7, m.cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    run = jax.jit(lambda p: moe_block.moe(x, p, prefix, m.cfg, "reference", backend="xla")[0])
    sub = lambda p: {n: a for n, a in p.items() if n.startswith(prefix + ".")}      # noqa: E731
    np.testing.assert_array_equal(np.asarray(run(sub(m.params))), np.asarray(run(sub(il))))


def test_n_fast_is_refused_outside_the_il_kernels():
    """Only the il kernels read their program ids the other way round: a launch order set on another family would be
    silently ignored by its kernels, so the shape check names it."""
    import dataclasses

    from dsflash.kernels import moe_gemm_triton as mt
    x, idx, weight, w1, s1, w3, s3, w2, s2 = moe_plan.random_moe_problem(jax.random.PRNGKey(5), 5, 2, 4, 256, 128)
    eo = dataclasses.replace(moe_plan.named_config("sw_eo_np"), n_fast=True)
    with pytest.raises(ValueError, match="n_fast"):
        mt._check_shapes(x, idx, w1, s1, w3, s3, w2, s2, eo)
    il = moe_plan.named_config("sw_il_bm128_nf")
    mt._check_shapes(x, idx, *L.repack_experts(w1, s1, w3, s3, w2, s2), il)      # accepted on il weights
    assert mt._grid(il, 288, 80, 1) == (80, 288, 1)
    with pytest.raises(ValueError, match="65535"):                              # CUDA's grid y limit
        mt._grid(il, 70_000, 80, 1)
    assert mt._grid(moe_plan.named_config("sw_il_bm128"), 70_000, 80, 1) == (70_000, 80, 1)


def test_group_m_needs_n_fast_and_the_il_kernels():
    """group_m reorders an n_fast launch only: without n_fast, or on another family, it would be silently ignored by
    the kernels, so the launcher names it; the grid is n_fast's (same programs, another order)."""
    import dataclasses

    from dsflash.kernels import moe_gemm_triton as mt
    x, idx, weight, w1, s1, w3, s3, w2, s2 = moe_plan.random_moe_problem(jax.random.PRNGKey(5), 5, 2, 4, 256, 128)
    with pytest.raises(ValueError, match="group_m"):
        mt._check_shapes(x, idx, w1, s1, w3, s3, w2, s2,
                         dataclasses.replace(moe_plan.named_config("sw_eo_np"), group_m=4))
    g4 = moe_plan.named_config("sw_il_bm128_nf_g4")
    mt._check_shapes(x, idx, *L.repack_experts(w1, s1, w3, s3, w2, s2), g4)      # accepted on il weights
    assert mt._grid(g4, 288, 80, 1) == (80, 288, 1)
    for bad in (dataclasses.replace(g4, n_fast=False), dataclasses.replace(g4, group_m=0)):
        with pytest.raises(ValueError, match="group_m"):
            mt._grid(bad, 288, 80, 1)


def test_plane_x_and_down_pair_are_refused_where_they_would_be_ignored():
    """plane_x reads x dequantised once (act "bf16rt"), down_pair reads h's planes (plane_h), both only in the il
    kernels: set anywhere else they would be silently ignored or read the wrong columns, so the shape check names the
    field; the serving wide config is accepted on il weights."""
    import dataclasses

    from dsflash.kernels import moe_gemm_triton as mt
    x, idx, weight, w1, s1, w3, s3, w2, s2 = moe_plan.random_moe_problem(jax.random.PRNGKey(5), 5, 2, 4, 256, 128)
    il_w = L.repack_experts(w1, s1, w3, s3, w2, s2)
    for field in ("plane_x", "down_pair"):
        with pytest.raises(ValueError, match=field):
            mt._check_shapes(x, idx, w1, s1, w3, s3, w2, s2,
                             dataclasses.replace(moe_plan.named_config("sw_eo_np"), **{field: True}))
    wide = moe_plan.named_config(moe_plan.IL_WIDE_CONFIG_NAME)
    assert wide.plane_x and wide.down_pair and wide.plane_h and wide.act == "bf16rt"
    mt._check_shapes(x, idx, *il_w, wide)                                        # accepted on il weights
    with pytest.raises(ValueError, match="plane_x.*bf16rt"):
        mt._check_shapes(x, idx, *il_w, dataclasses.replace(wide, act="fp8"))
    with pytest.raises(ValueError, match="down_pair.*plane_h"):
        mt._check_shapes(x, idx, *il_w, dataclasses.replace(wide, plane_h=False))


def test_tile_major_is_an_exact_permutation_with_contiguous_tiles():
    """``to_tiles`` (config ``tile_major``): same shapes and dtypes, ``from_tiles`` undoes it exactly, and the 64 rows
    x 32 halfwords (x 1 scale word) of each (row block, slab) of an expert are one contiguous run, rows in order."""
    wh, sw = L.repack(*_weights(7, (2, 192, 384)))         # 3 row blocks, 3 slabs: a block / slab mix-up shows
    tw, ts = L.to_tiles(wh, sw)
    assert (tw.dtype, tw.shape, ts.dtype, ts.shape) == (wh.dtype, wh.shape, sw.dtype, sw.shape)
    assert not np.array_equal(np.asarray(tw), np.asarray(wh))
    bw, bs = L.from_tiles(tw, ts)
    np.testing.assert_array_equal(np.asarray(bw), np.asarray(wh))
    np.testing.assert_array_equal(np.asarray(bs), np.asarray(sw))
    flat_w, flat_s = np.asarray(tw).reshape(2, -1), np.asarray(ts).reshape(2, -1)
    il_w, il_s = np.asarray(wh), np.asarray(sw)
    KW = 384 // L.BK
    for e in range(2):
        for nb in range(3):
            for j in range(KW):
                t = (nb * KW + j) * L.BN
                np.testing.assert_array_equal(flat_w[e, t * L.HALF:(t + L.BN) * L.HALF].reshape(L.BN, L.HALF),
                                              il_w[e, nb * L.BN:(nb + 1) * L.BN, j * L.HALF:(j + 1) * L.HALF])
                np.testing.assert_array_equal(flat_s[e, t:t + L.BN], il_s[e, nb * L.BN:(nb + 1) * L.BN, j])
    rw = np.random.default_rng(0).integers(0, 2 ** 16, (3, 128, 64), dtype=np.uint16)   # any bits, the real dtypes
    rs = np.random.default_rng(1).integers(0, 2 ** 32, (3, 128, 2), dtype=np.uint32)
    back = L.from_tiles(*L.to_tiles(rw, rs))
    np.testing.assert_array_equal(np.asarray(back[0]), rw)
    np.testing.assert_array_equal(np.asarray(back[1]), rs)
    with pytest.raises(ValueError, match="divisible by 64"):
        L.to_tiles(rw[:, :96], rs[:, :96])


def test_tile_major_is_refused_outside_the_il_kernels_and_off_64_row_blocks():
    """Only the il kernels read tile-major addresses, and its tiles are 64 rows: set elsewhere it would be silently
    ignored (wrong outputs from permuted weights), so the shape check names the field; the named twins are accepted on
    il weights."""
    import dataclasses

    from dsflash.kernels import moe_gemm_triton as mt
    x, idx, weight, w1, s1, w3, s3, w2, s2 = moe_plan.random_moe_problem(jax.random.PRNGKey(5), 5, 2, 4, 256, 128)
    il_w = L.tile_experts(*L.repack_experts(w1, s1, w3, s3, w2, s2))
    with pytest.raises(ValueError, match="tile_major"):
        mt._check_shapes(x, idx, w1, s1, w3, s3, w2, s2,
                         dataclasses.replace(moe_plan.named_config("sw_eo_np"), tile_major=True))
    for name in ("sw_il_tm", "sw_il_bm32_tm", "sw_il_bm64_xb_tm", "sw_il_tm2", "sw_il_bm32_tm2"):
        cfg = moe_plan.named_config(name)
        level = 2 if name.endswith("2") else 1
        base = name[:-4] if level == 2 else name[:-3]
        assert cfg.tile_major == level and cfg == dataclasses.replace(moe_plan.named_config(base), tile_major=level)
        mt._check_shapes(x, idx, *il_w, cfg)                                    # accepted on il weights
        with pytest.raises(ValueError, match="BN_UP=BN_DOWN=64"):
            mt._check_shapes(x, idx, *il_w, dataclasses.replace(cfg, BN_DOWN=128))
        for p in (1, 2, 5, 7) if name != "sw_il_bm64_xb_tm" else ():     # the ladder's rungs (gpu_queue.sh moe_tm)
            assert moe_plan.named_config(f"{name}_probe{p}") == dataclasses.replace(cfg, probe=p)
    with pytest.raises(ValueError, match="tile_major is 0"):
        mt._check_shapes(x, idx, *il_w, dataclasses.replace(moe_plan.named_config("sw_il"), tile_major=3))
    with pytest.raises(ValueError, match="probe 6"):
        mt._check_shapes(x, idx, *il_w, dataclasses.replace(moe_plan.named_config("sw_il_tm2"), probe=6))


def test_tile_major_level_2_stores_each_runs_scale_words_in_the_kernels_load_order():
    """``to_tiles(level=2)`` (config ``tile_major`` 2, session 30): the halfwords are level 1's, and each tile's 64
    scale words are one run in ``_il_rows``' load order (run word rho = memory row ``LOAD_ROWS[rho]``'s word), so the
    kernel's scale read of a step is ``s_base + t * 64 + arange(64)``; ``from_tiles(level=2)`` undoes it, and
    ``LOAD_ROWS`` is the kernel's ``_il_rows`` (bits g = rho % 8, rho3, rho4, rho5 -> g + 8 rho5 + 16 rho3 +
    32 rho4)."""
    assert sorted(L.LOAD_ROWS.tolist()) == list(range(64))
    for rho in range(64):
        assert L.LOAD_ROWS[rho] == (rho % 8) + 8 * ((rho >> 5) & 1) + 16 * ((rho >> 3) & 1) + 32 * ((rho >> 4) & 1)
    wh, sw = L.repack(*_weights(9, (2, 192, 384)))          # 3 row blocks, 3 slabs
    w1_, s1_ = L.to_tiles(wh, sw)
    w2_, s2_ = L.to_tiles(wh, sw, level=2)
    np.testing.assert_array_equal(np.asarray(w2_), np.asarray(w1_))
    assert s2_.shape == sw.shape and s2_.dtype == sw.dtype
    flat_s, il_s = np.asarray(s2_).reshape(2, -1), np.asarray(sw)
    KW = 384 // L.BK
    for e in range(2):
        for nb in range(3):
            for j in range(KW):
                t = (nb * KW + j) * L.BN
                # the kernel's load: offs_l = _il_rows(nb) = nb * 64 + LOAD_ROWS; word rho of the run is that row's
                np.testing.assert_array_equal(flat_s[e, t:t + L.BN], il_s[e, nb * L.BN + L.LOAD_ROWS, j])
    bw, bs = L.from_tiles(w2_, s2_, level=2)
    np.testing.assert_array_equal(np.asarray(bw), np.asarray(wh))
    np.testing.assert_array_equal(np.asarray(bs), np.asarray(sw))
    assert not np.array_equal(np.asarray(L.from_tiles(w2_, s2_)[1]), np.asarray(sw))   # level 1's inverse: wrong
    k = L.tile_experts(wh, sw, wh, sw, wh[:, :, :32], sw[:, :, :1], level=2)
    np.testing.assert_array_equal(np.asarray(k[1]), np.asarray(s2_))
    with pytest.raises(ValueError, match="level"):
        L.to_tiles(wh, sw, level=3)
    with pytest.raises(ValueError, match="bn must be 64"):
        L.to_tiles(wh, sw, bn=32, level=2)
