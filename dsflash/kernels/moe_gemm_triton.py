"""Triton (jax-triton) routed-expert grouped GEMM with MXFP4 weights dequantised in-kernel.

Same signature and contract as ``moe_gemm.routed_moe_reference``; see that module for the numerics.

How it works
------------
* JAX side (cheap, O(T k)): activations take the FP8 E4M3 per-32 quantisation of the reference
  (``quant.fp8_quant``: codes + pow2 scales, bit-identical to the reference round trip); the T*k token
  slots are sorted by expert (stable) and cut into M-tiles of ``BM`` rows that never cross an expert
  (tile table: expert, first row, end row; spare tiles carry expert -1 and exit at once).
* Kernel 1 ``_moe_up_kernel`` (fused gate/up): per (M-tile, N-block of I) it reads the gathered FP8 token
  rows and the MXFP4 W1 and W3 rows of that expert, 32 K-elements at a time. An E2M1 nibble maps
  exactly onto an E4M3 byte worth value * 2^-6 (sign to bit 7, the 3 magnitude bits to bits 2-4;
  subnormal 0.5 included), so the weights go to the FP8 tensor cores without any float math; each
  32-wide K block's partial product is scaled by act_scale * weight_scale * 2^6 (all powers of two,
  exact) and accumulated in fp32. Epilogue: bf16 rounding of both GEMM results, clamp, SiLU, routing weight
  before W2, bf16 rounding, FP8 E4M3 per-32 quantisation of h (codes + pow2 scales) -- the reference's round
  trip, fused.
* Kernel 2 ``_moe_down_kernel``: h (sorted rows, FP8) times MXFP4 W2 the same way, bf16 rounding,
  rows stored back at their unsorted slot; the k slots of a token are summed in fp32 by XLA.
* ``precision="bf16"`` (clearly a variant, not the released numerics): no FP8 activation round trips;
  bf16 activations, weights decoded E2M1 -> E4M3 -> bf16 in-kernel, bf16 tensor cores, h stored bf16.
  ``precision="fp32"`` is not offered by the kernel (use the reference).
* Nibble decoding: ``DECODE="asm"`` (default on GPU) decodes 8 nibbles per 32-bit register with four
  shifts/ands (inline PTX); ``DECODE="tl"`` is the same in plain Triton ops (also runs in Triton's
  interpreter).
* ``kind="ds"`` kernels (``_moe_*_kernel_ds``) use ``tl.dot_scaled`` instead: E4M3 activations with UE8M0 scales
  (or bf16) times packed E2M1 weights with their UE8M0 scales; on Hopper Triton upcasts both to bf16 with the
  scales applied (exact) and accumulates a BK-wide chunk in one bf16 MMA. ``act="bf16rt"`` feeds bf16 carriers of
  the same FP8 round-tripped values (x dequantised in-kernel, h round-tripped in the epilogue).
* ``kind="sk"`` kernels (``_moe_*_kernel_sk``, decode): the K dimension of both GEMMs split over a third grid axis
  (``moe_plan.split_ks``: enough programs to fill the GPU when only a few experts are active), fp32 partials
  summed in a fixed order by ``_moe_up_epilogue_sk`` (then the usual epilogue) and ``_moe_down_reduce_sk`` (then the
  bf16 rounding of each expert's output). ``mma="bf16"`` loads BK-wide weight slabs (16-byte vectors), prefetches
  the next slab into registers and decodes to bf16 with the scales applied (exact) for one bf16 MMA per slab;
  ``mma="fp8"`` is the per-32 FP8-MMA loop above, split.
* ``mma="swap"`` / ``"swap_eo"`` / ``"swap_bd"`` (``_moe_*_kernel_sw``): the same split-K plan with the weights as the
  MMA's left operand (acc^T = W . x^T; Hopper wgmma reads it from registers, and the weight rows fill its M while a
  decode tile's token rows are its N); "swap_eo" keeps the even / odd K elements (low / high nibbles) as two planes
  instead of interleaving them, "swap_bd" builds their bf16 bits in inline PTX. The defaults since 2026-11-30
  (``sw_eo_np`` decode, ``sw_eo_prefill_w8`` prefill) are "swap_eo" with Triton's own load pipelining.
* ``mma="swap_ps"`` (``_moe_*_kernel_ps``, 2026-12-01, named variants, not defaults): swapped operands with the
  scales applied after the MMA -- per 32-wide K group an fp16 MMA of the raw codes (weight nibbles as E4M3 -> fp16,
  the activations' E4M3 codes), then the fp32 partial times weight scale x activation scale (powers of two) into the
  accumulator; FP8 activations only, h as FP8 codes + scales. BM 8 tiles make Triton use mma.sync instead of wgmma.
* ``mma="swap_il"`` (``kernels/experimental/moe_layout_kernels.py``, 2026-12-03, named ``sw_il`` and its wider-tile
  twins ``sw_il_bm32`` / ``bm64`` / ``bm128``; what ``pick_config`` gives il weights at every size since run 39): "swap_eo" on weights in the load-time "il" layout (``kernels/moe_layout.py``: uint16 halfwords
  [E, N, K/4] + uint32 scale words [E, N, K/128], made once by ``moe_layout.repack_experts`` /
  ``model.params.moe_il_weights``): nibbles pre-arranged so that a shift + mask gives bf16 bit patterns and one bf16x2
  multiply applies the scale; bit-identical to ``sw_eo_np``. The layout is told by the weights' dtype: il weights run
  "swap_il" at every size (``moe_plan.IL_BANDS``); an explicit checkpoint-layout config gets them converted back per
  call (correct, slow), and so does the XLA reference. ``split_gate_up`` (experimental ``sw_il_gu``...): the gate and
  up rows in separate programs, through the split-K epilogue (more programs per SM; bit-identical at the same split).
Configs live in ``moe_plan`` (``NAMED_CONFIGS``); ``pick_config`` chooses by rows per expert and activation format (defaults
from the 2026-11-30 H200 measurements, see NOTES.md and benchmarks/BENCHMARKS.md).

Where the code lives: ``moe_gemm_kernels`` holds the default family (the swapped-operand kernels and the split-K
epilogue / reduction), ``triton_common`` the helpers shared with the FP8 dense linear, and
``kernels/experimental/moe_families.py`` the kinds "fp8mma" / "ds" and the mma "fp8" / "bf16" / "gemv" / "swap_ps"
kernels, imported only when one of their (non-default) configs is launched.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsflash.kernels import moe_layout
from dsflash.kernels.moe_gemm_kernels import _down_reduce, _moe_down_kernel_sw, _moe_up_kernel_sw, _up_epilogue
from dsflash.kernels.moe_plan import (DECODE_CONFIG, PREFILL_CONFIG, MoeConfig, fit_config, num_tiles, pick_config,  # noqa: F401
                                      prepare, split_ks, tile_schedule, up_blocks)


def _experimental():
    """The non-default kernel families (imported on first use, so the default configs never load them)."""
    from dsflash.kernels.experimental import moe_families
    return moe_families


def _il_kernels():
    """The load-time-layout kernel family (mma "swap_il"), imported on first use like ``_experimental``."""
    from dsflash.kernels.experimental import moe_layout_kernels
    return moe_layout_kernels


# ------------------------------------------------------------------------------------------ JAX side
def _check_shapes(x, idx, w1, s1, w3, s3, w2, s2, cfg):
    T, d = x.shape
    E, I, _ = w1.shape
    if cfg.kind == "sk" and cfg.mma == "swap_il":     # il layout: uint16 [E, N, K/4] + uint32 [E, N, K/128]
        assert moe_layout.is_il(w1) and moe_layout.is_il(w3) and moe_layout.is_il(w2), (w1.dtype, w2.dtype)
        assert w1.shape == (E, I, d // 4) and w3.shape == w1.shape and w2.shape == (E, d, I // 4), \
            (x.shape, w1.shape, w2.shape)
        assert s1.shape == (E, I, d // 128) and s3.shape == s1.shape and s2.shape == (E, d, I // 128)
        _il_kernels().check_config(cfg)
        if d % moe_layout.BK or I % moe_layout.BK:
            raise ValueError(f"mma 'swap_il' needs d and I divisible by {moe_layout.BK}; got d={d}, I={I}")
        if cfg.down_pair and d % (2 * cfg.BN_DOWN):
            raise ValueError(f"down_pair computes 2 x BN_DOWN={cfg.BN_DOWN} columns a program: d={d} must divide")
    elif (cfg.split_gate_up or cfg.n_fast or cfg.group_m != 1 or cfg.plane_h or cfg.plane_x or cfg.down_pair
          or cfg.tile_major):
        raise ValueError(f"split_gate_up / n_fast / group_m / plane_h / plane_x / down_pair / tile_major are variants "
                         f"of mma 'swap_il' only; got mma {cfg.mma!r}")
    else:
        dh = w1.shape[2]
        assert dh * 2 == d and w3.shape == w1.shape and w2.shape == (E, d, I // 2), (x.shape, w1.shape, w2.shape)
        assert s1.shape == (E, I, d // 32) and s3.shape == s1.shape and s2.shape == (E, d, I // 32)
    for n, b in (("I", cfg.BN_UP), ("d", cfg.BN_DOWN)):
        size = I if n == "I" else d
        if size % b or b % 32:
            raise ValueError(f"{n}={size} must be a multiple of the block {b} (itself a multiple of 32)")
    if cfg.kind == "sk":
        unit = 32 * cfg.KSUB if cfg.mma == "fp8" else cfg.BK
        if d % unit or I % unit or unit % 32:
            raise ValueError(f"K unit {unit} (BK or 32*KSUB) must be a multiple of 32 dividing d={d} and I={I}")
    if cfg.kind == "ds" and (d % cfg.BK or I % cfg.BK or cfg.BK % 32):
        raise ValueError(f"BK={cfg.BK} must be a multiple of 32 dividing d={d} and I={I}")
    if (d // 32) % cfg.KSUB or (I // 32) % cfg.KSUB:
        raise ValueError(f"KSUB={cfg.KSUB} must divide d/32={d // 32} and I/32={I // 32}")


def _as_u8(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype == jnp.int8 else a


def _launch(p, w1, s1, w3, s3, w2, s2, *, T, k, d, I, E, limit, act_fp8, cfg):
    """The two kernel launches on prepared inputs (``prepare``) -> (o [S, d] bf16 per slot, hq, hs)."""
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only

    S = T * k
    TM = num_tiles(S, E, cfg.BM)
    if cfg.kind == "sk":
        return _launch_sk(jt, p, w1, s1, w3, s3, w2, s2, S=S, TM=TM, d=d, I=I, E=E, limit=limit, act_fp8=act_fp8,
                          cfg=cfg)
    return _experimental().launch_unsplit(jt, p, w1, s1, w3, s3, w2, s2, S=S, TM=TM, d=d, I=I, limit=limit,
                                          act_fp8=act_fp8, cfg=cfg)


def sk_plan(cfg: MoeConfig, S, E, d, I, act_fp8=True):
    """Static launch plan of a kind-"sk" config: K splits, the MMA flavour and how h travels."""
    ks_up, ks_down = split_ks(cfg, S, E, d, I)
    mma = {"fp8": 0, "bf16": 1, "gemv": 2, "swap": 3, "swap_eo": 4, "swap_bd": 5, "swap_ps": 6, "swap_il": 7}[cfg.mma]
    if not act_fp8 and mma in (0, 6):
        raise NotImplementedError(f"kind 'sk' with mma={cfg.mma!r} needs FP8 activations (precision 'reference')")
    if mma == 2 and cfg.BM != 1:
        raise ValueError("mma='gemv' needs BM=1 (one row per tile)")
    hout = (0 if mma in (0, 6) else 1) if act_fp8 else 2   # FP8 codes + scales / bf16 carrier of the round trip / bf16
    return dict(ks_up=ks_up, ks_down=ks_down, mma=mma, hout=hout)


def _grid(cfg: MoeConfig, tiles, blocks, splits):
    """A kind-"sk" launch grid: M tiles fastest (program_id 0), or with ``cfg.n_fast`` the column blocks fastest
    (the il kernels read their program ids the same way round: ``moe_layout_kernels._tile_il``)."""
    if cfg.group_m < 1 or (cfg.group_m > 1 and not cfg.n_fast):
        raise ValueError(f"group_m groups the M tiles of an n_fast launch: it needs n_fast and group_m >= 1; got "
                         f"n_fast={cfg.n_fast}, group_m={cfg.group_m}")
    if cfg.n_fast and tiles > 65535:            # CUDA's grid y limit (x takes 2**31 - 1)
        raise ValueError(f"n_fast puts the M tiles on the grid's y axis (at most 65535); got {tiles} tiles: "
                         f"use a wider tile (BM) or a config without n_fast")
    return (blocks, tiles, splits) if cfg.n_fast else (tiles, blocks, splits)


def _launch_sk(jt, p, w1, s1, w3, s3, w2, s2, *, S, TM, d, I, E, limit, act_fp8, cfg):
    """Split-K decode launches: up (+ epilogue when split), down (+ reduction when split)."""
    pl = sk_plan(cfg, S, E, d, I, act_fp8)
    ks_up, ks_down, mma, hout = pl["ks_up"], pl["ks_down"], pl["mma"], pl["hout"]
    dec = int(cfg.decode == "asm")
    hdt = jnp.float8_e4m3fn if hout == 0 else jnp.bfloat16
    h_shapes = (jax.ShapeDtypeStruct((S, I), hdt), jax.ShapeDtypeStruct((S, I // 32), jnp.float32))
    up_args = (p["xq"], p["xs"], p["tok"], p["rw"], p["tile_e"], p["tile_s"], p["tile_end"], w1, s1, w3, s3)
    x_fp8 = act_fp8
    up_only, down_only = {}, {}     # each kernel's own constexprs
    if mma in (3, 4, 5):      # "swap" / "swap_eo" / "swap_bd": the default family
        kern_up, kern_down = _moe_up_kernel_sw, _moe_down_kernel_sw
        common = dict(D=d, I=I, BM=cfg.BM, BK=cfg.BK, EO=mma - 3, PREFETCH=int(cfg.prefetch), DECODE=dec)
    elif mma == 7:            # "swap_il": weights in the load-time il layout
        kern_up, kern_down, common = _il_kernels().il_kernels(cfg, d=d, I=I, dec=dec)
        up_only = _il_kernels().il_up_constexprs(cfg)
        down_only = _il_kernels().il_down_constexprs(cfg)
        if act_fp8 and cfg.act == "bf16rt":    # x dequantised once, not in each column tile's loop
            up_args = (_il_kernels().x_dequant(jt, p["xq"], p["xs"], planes=cfg.plane_x),) + up_args[1:]
            x_fp8 = False                       # the up kernel's x only: h still travels as sk_plan says
        elif cfg.plane_x:                       # precision "bf16": x is bf16 already, only reordered
            up_args = (_il_kernels().to_planes(p["xq"]),) + up_args[1:]
    elif mma == 2:
        return _experimental().launch_gemv(jt, p, up_args, w2, s2, h_shapes, S=S, TM=TM, d=d, I=I, limit=limit,
                                           act_fp8=act_fp8, cfg=cfg, ks_up=ks_up, ks_down=ks_down, hout=hout, dec=dec)
    else:
        kern_up, kern_down, common = _experimental().sk_kernels(cfg, mma, d=d, I=I, dec=dec)
    if cfg.plane_h and (ks_up != 1 or cfg.split_gate_up):
        raise ValueError(f"plane_h is written by the joint up kernel's own epilogue: it needs KS_UP 1 and no "
                         f"split_gate_up; got ks_up={ks_up}, split_gate_up={cfg.split_gate_up}")
    if ks_up == 1 and not cfg.split_gate_up:    # (split gate / up rows always go through the partials)
        hq, hs = jt.triton_call(
            *up_args, kernel=kern_up, out_shape=h_shapes,
            grid=_grid(cfg, TM, I // cfg.BN_UP, 1), num_warps=cfg.warps_up, num_stages=cfg.stages,
            S=S, LIMIT=float(limit), BN=cfg.BN_UP, KS=1, ACT_FP8=int(x_fp8), HOUT=hout, **common, **up_only)
    else:
        part, _ = jt.triton_call(
            *up_args, kernel=kern_up,
            out_shape=(jax.ShapeDtypeStruct((ks_up, S, 2 * I), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32)),
            grid=_grid(cfg, TM, up_blocks(cfg, I), ks_up), num_warps=cfg.warps_up, num_stages=cfg.stages,
            S=S, LIMIT=float(limit), BN=cfg.BN_UP, KS=ks_up, ACT_FP8=int(x_fp8), HOUT=hout, **common, **up_only)
        hq, hs = _up_epilogue(jt, part, p, h_shapes, S=S, I=I, limit=limit, ks_up=ks_up, hout=hout)
    down_args = (hq, hs, p["order"], p["tile_e"], p["tile_s"], p["tile_end"], w2, s2)
    down_blocks = d // cfg.BN_DOWN // (2 if cfg.down_pair else 1)
    if ks_down == 1:
        o = jt.triton_call(
            *down_args, kernel=kern_down, out_shape=jax.ShapeDtypeStruct((S, d), jnp.bfloat16),
            grid=_grid(cfg, TM, down_blocks, 1), num_warps=cfg.warps_down,
            num_stages=cfg.stages_down or cfg.stages, S=S, BN=cfg.BN_DOWN, KS=1, **common, **down_only)
    else:
        part = jt.triton_call(
            *down_args, kernel=kern_down, out_shape=jax.ShapeDtypeStruct((ks_down, S, d), jnp.float32),
            grid=_grid(cfg, TM, down_blocks, ks_down), num_warps=cfg.warps_down,
            num_stages=cfg.stages_down or cfg.stages, S=S, BN=cfg.BN_DOWN, KS=ks_down, **common, **down_only)
        o = _down_reduce(jt, part, S=S, d=d, ks_down=ks_down)
    return o, hq, hs


def routed_moe_triton(x, idx, weight, w1, s1, w3, s3, w2, s2, *, limit, precision="reference",
                      config: MoeConfig | None = None, return_intermediates=False):
    if precision not in ("reference", "bf16"):
        raise NotImplementedError(f"the Triton MoE GEMM implements precision 'reference' (FP8 activations) and "
                                  f"'bf16'; got {precision!r} (use backend='xla')")
    act_fp8 = precision == "reference"
    T, d = x.shape
    k = idx.shape[1]
    E, I, _ = w1.shape
    S = T * k
    il = moe_layout.is_il(w1)
    cfg = config or fit_config(pick_config(S, E, act_fp8, layout="il" if il else "checkpoint"), d, I)
    if il and not (cfg.kind == "sk" and cfg.mma == "swap_il"):
        # il weights under an explicit checkpoint-layout config: converted back here, per call (correct, slow;
        # pick_config never does this since run 39)
        w1, s1, w3, s3, w2, s2 = _il_to_checkpoint(w1, s1, w3, s3, w2, s2)
    elif not il and cfg.kind == "sk" and cfg.mma == "swap_il":
        raise ValueError("config mma 'swap_il' needs the routed-expert weights in the il layout, made once at load "
                         "time: moe_layout.repack_experts(...) or dsflash.model.params.moe_il_weights(cfg, params)")
    _check_shapes(x, idx, w1, s1, w3, s3, w2, s2, cfg)
    p = prepare(x, idx, weight, E=E, BM=cfg.BM, act_fp8=act_fp8)
    w1, w3, w2 = _as_u8(w1), _as_u8(w3), _as_u8(w2)
    o, hq, hs = _launch(p, w1, s1, w3, s3, w2, s2, T=T, k=k, d=d, I=I, E=E, limit=limit, act_fp8=act_fp8, cfg=cfg)
    # Slots routed to id E (ep_moe's marker for "not a local expert") sort last and belong to no tile, so their o
    # rows are never written (jax-triton does not zero outputs): mask them, as the reference's ragged_dot does.
    local = ((idx >= 0) & (idx < E)).reshape(T, k, 1)
    out = jnp.sum(jnp.where(local, o.reshape(T, k, d).astype(jnp.float32), 0.0), axis=1)
    if return_intermediates:
        if cfg.plane_h:     # back to the natural column order, so h compares with every other config's
            hq = _il_kernels().h_from_planes(hq)
        return out, dict(p, hq=hq, hs=hs, o=o)
    return out


def _il_to_checkpoint(w1, s1, w3, s3, w2, s2):
    return (*moe_layout.to_checkpoint(w1, s1), *moe_layout.to_checkpoint(w3, s3), *moe_layout.to_checkpoint(w2, s2))


@functools.lru_cache(maxsize=None)
def jitted(limit, precision="reference", config: MoeConfig | None = None):
    return jax.jit(functools.partial(routed_moe_triton, limit=limit, precision=precision, config=config))
