"""A numpy emulator of the few PTX instructions that the inline-asm blocks of the Triton kernels use, so their bit
logic can be checked on a CPU host (Triton's interpreter cannot run inline asm). Vectorised: every register is a
uint32 array, one lane per asm invocation.

Instructions (PTX ISA semantics; the float ones as documented for sm_90, NOT checked against a GPU here):
  mov.b32, and.b32, or.b32, xor.b32, shl.b32, shr.b32 / shr.u32 (shift counts < 32), prmt.b32 (generic mode: byte
  i of d = byte (c >> 4i) & 7 of {b, a}, or with bit 3 of that nibble set its sign bit replicated), max.u16x2,
  mul.rn.bf16x2 (each half: the exact product rounded to nearest even, subnormals kept, overflow to inf, NaN
  -> the canonical 0x7FFF), cvt.rn.bf16x2.f32 d, a, b (a to the upper half; RNE, no ftz, NaN -> 0x7FFF).
Operands: $k (the asm's operands, constraint order), .reg names, integer literals (decimal or 0x hex).

    out = run(asm_text, {"$4": words, "$5": scales}, n_out=4)   # -> [$0, $1, $2, $3] uint32 arrays
"""
from __future__ import annotations

import re

import numpy as np

M32 = np.uint64(0xFFFFFFFF)


def bf16_rne_bits(x) -> np.ndarray:
    """float64 values -> bf16 bit patterns (uint16), round to nearest even, subnormals kept (quantum 2^-133),
    overflow to +-inf, NaN -> 0x7FFF."""
    x = np.asarray(x, np.float64)
    out = np.zeros(x.shape, np.uint32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return _bf16_rne_bits(x, out)


def _bf16_rne_bits(x, out):
    nan = np.isnan(x)
    fin = np.isfinite(x) & (x != 0)
    a = np.abs(np.where(fin, x, 1.0))
    e = np.maximum(np.frexp(a)[1] - 1, -126).astype(np.float64)    # 2^e <= a < 2^(e+1), or the subnormal binade
    q = 2.0 ** (e - 7)
    r = np.round(a / q) * q                       # numpy rounds half to even; a / q is exact (power-of-two q)
    r = np.where(r >= 2.0 ** 128, np.inf, r)
    bits32 = np.abs(r).astype(np.float32).view(np.uint32)   # exact: r has <= 8 significant bits
    sign = np.where(np.signbit(x), np.uint32(0x8000), np.uint32(0))
    mag = (bits32 >> 16).astype(np.uint32)
    out = np.where(fin, mag | sign, out)
    zero = (x == 0)
    out = np.where(zero, sign, out)
    inf = np.isinf(x)
    out = np.where(inf, np.uint32(0x7F80) | sign, out)
    out = np.where(nan, np.uint32(0x7FFF), out)
    return out.astype(np.uint16)


def bf16_value(bits) -> np.ndarray:
    """bf16 bit patterns -> float64 values (exact)."""
    b = np.asarray(bits, np.uint32) << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def _halves(v):
    v = np.asarray(v, np.uint32)
    return v & 0xFFFF, v >> 16


def _join(lo, hi):
    return (np.asarray(lo, np.uint32) & 0xFFFF) | ((np.asarray(hi, np.uint32) & 0xFFFF) << 16)


def _prmt(a, b, c):
    src = (np.asarray(b, np.uint64) << np.uint64(32)) | np.asarray(a, np.uint64)
    c = np.asarray(c, np.uint32)
    out = np.zeros(np.broadcast(a, b, c).shape, np.uint32)
    for i in range(4):
        ctl = (c >> (4 * i)) & 0xF
        byte = ((src >> ((ctl & 7).astype(np.uint64) * np.uint64(8))) & np.uint64(0xFF)).astype(np.uint32)
        byte = np.where(ctl & 8, np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0)), byte)
        out |= byte << (8 * i)
    return out


def _mul_bf16x2(a, b):
    (al, ah), (bl, bh) = _halves(a), _halves(b)
    with np.errstate(invalid="ignore", over="ignore"):        # 0 x inf, overflow: NaN / inf, as the hardware
        lo = bf16_rne_bits(bf16_value(al) * bf16_value(bl))
        hi = bf16_rne_bits(bf16_value(ah) * bf16_value(bh))
    return _join(lo, hi)


def _cvt_bf16x2_f32(a, b):
    with np.errstate(invalid="ignore"):                         # signalling NaN payloads
        fa = np.asarray(a, np.uint32).view(np.float32).astype(np.float64)
        fb = np.asarray(b, np.uint32).view(np.float32).astype(np.float64)
    return _join(bf16_rne_bits(fb), bf16_rne_bits(fa))


def _max_u16x2(a, b):
    (al, ah), (bl, bh) = _halves(a), _halves(b)
    return _join(np.maximum(al, bl), np.maximum(ah, bh))


_OPS = {
    "mov.b32": lambda a: a,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "xor.b32": lambda a, b: a ^ b,
    "shl.b32": lambda a, b: ((a.astype(np.uint64) << b.astype(np.uint64)) & M32).astype(np.uint32),
    "shr.b32": lambda a, b: a >> b,
    "shr.u32": lambda a, b: a >> b,
    "prmt.b32": _prmt,
    "max.u16x2": _max_u16x2,
    "mul.rn.bf16x2": _mul_bf16x2,
    "cvt.rn.bf16x2.f32": _cvt_bf16x2_f32,
}


def run(asm: str, inputs: dict, n_out: int) -> list:
    """Execute ``asm`` (one inline-asm block) on ``inputs`` ({"$k": uint32 array}); returns [$0 .. $(n_out-1)]."""
    regs = {k: np.asarray(v, np.uint32) for k, v in inputs.items()}
    body = asm.replace("{", "\n").replace("}", "\n")
    for stmt in body.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg") or stmt.startswith("//"):
            continue
        m = re.match(r"^(\S+)\s+(.*)$", stmt, re.S)
        if not m:
            raise ValueError(f"cannot parse {stmt!r}")
        op, args = m.group(1), [x.strip() for x in m.group(2).split(",")]
        if op not in _OPS:
            raise NotImplementedError(f"ptx_emu: {op}")
        vals = []
        for x in args[1:]:
            if re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", x):
                vals.append(np.uint32(int(x, 0)))
            elif x in regs:
                vals.append(regs[x])
            else:
                raise KeyError(f"ptx_emu: {x} read before it was written in {stmt!r}")
        regs[args[0]] = np.asarray(_OPS[op](*[np.asarray(v, np.uint32) for v in vals]), np.uint32)
    return [regs[f"${i}"] for i in range(n_out)]
