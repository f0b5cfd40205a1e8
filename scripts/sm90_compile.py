"""Compile Triton kernels for sm_90 (H100 / H200) on a CPU-only host and report what the GPU would run.

No GPU or driver is needed: ``triton.compile`` with an explicit ``GPUTarget("cuda", 90, 32)`` runs the whole
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) and the triton wheel bundles ptxas / nvdisasm. Per kernel it prints
registers per thread, spill stores / loads (ptxas -v), static shared memory (Triton's metadata), whether wgmma, HMMA
(mma.sync), cp.async, TMA and ldmatrix appear, the SASS instruction count, a SASS opcode histogram, and the same for
the hottest loop (the innermost backward branch holding MMA instructions, or the largest loop) with the instruction
count per weight element when the caller says how many weight elements one loop iteration consumes.

Usage:
  # a named MoE config (dsflash.kernels.moe_plan.named_config) at a token count, exactly as the launcher
  # (moe_gemm_triton._launch) would compile it at V4.1's shapes (d 5120, I 2304, 96 local experts, top-6):
  python scripts/sm90_compile.py moe sw_eo_np --tokens 1,16 [--precision reference|bf16] [--sass DIR] [--top 25]
  # any @triton.jit kernel: module:function, pointer args as NAME=*dtype (u8, fp32, bf16, fp8e4nv, i32, ...),
  # constexprs as NAME=value (int / float / str):
  python scripts/sm90_compile.py kernel dsflash.kernels.mhc_fused_triton:_some_kernel \\
      --sig x_ptr=*bf16 o_ptr=*fp32 --const BT=16 BD=64 --warps 4 --stages 3 [--loop-elems N]
From Python: ``compile_kernel(fn, signature, constexprs, num_warps=..., num_stages=...)`` returns a ``Report``
(``.summary()``, ``.sass``, ``.ptx``); ``moe_reports(name, tokens)`` the reports of one MoE config's launches.

Caveats: the SASS count of a loop is per warp and per iteration, static (not what ncu counts at run time);
"per weight element" multiplies by 32 x num_warps threads and divides by the elements of one iteration, given by
the caller (the MoE mode knows them for the swapped / slab kernels). All array arguments are assumed 16-byte
aligned, as jax-triton assumes (tt.divisibility 16 on every pointer); ints passed positionally are not specialised.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_MMA_OPS = ("HGMMA", "HMMA", "QGMMA", "IMMA", "IGMMA")


def _tool(name):
    d = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    p = os.path.join(d, name)
    return p if os.path.exists(p) else name


@dataclasses.dataclass
class Loop:
    start: int           # instruction index of the loop head (branch target)
    end: int             # index of the backward branch
    ops: collections.Counter

    @property
    def n(self):
        return self.end - self.start + 1


@dataclasses.dataclass
class Report:
    name: str
    num_warps: int
    num_stages: int
    regs: int
    spill_stores: int
    spill_loads: int
    smem: int
    ptx: str
    sass: str
    ops: collections.Counter
    loops: list
    features: dict
    ptxas_log: str
    label: str = ""
    loop_elems: int = 0      # weight elements consumed per iteration of the main loop (0: unknown)

    @property
    def main_loop(self):
        mma = [lp for lp in self.loops if any(lp.ops[o] for o in _MMA_OPS)]
        cands = mma or self.loops
        if not cands:
            return None
        # the innermost loop with MMAs (smallest body among those holding MMAs), else the largest loop
        return min(cands, key=lambda lp: lp.n) if mma else max(cands, key=lambda lp: lp.n)

    def per_elem(self):
        lp = self.main_loop
        if lp is None or not self.loop_elems:
            return None
        return lp.n * 32 * self.num_warps / self.loop_elems

    def summary(self, top=20):
        out = [f"== {self.label or self.name}  (warps {self.num_warps}, stages {self.num_stages})",
               f"   registers {self.regs}, spill stores {self.spill_stores} B, spill loads {self.spill_loads} B, "
               f"shared memory {self.smem} B, occupancy (regs) {_occupancy(self.regs, self.num_warps, self.smem)}",
               "   features: " + ", ".join(f"{k} {v}" for k, v in self.features.items()),
               f"   SASS instructions {sum(self.ops.values())}; loops (instructions per iteration): "
               + (", ".join(str(lp.n) for lp in self.loops) or "none")]
        lp = self.main_loop
        if lp is not None:
            pe = self.per_elem()
            out.append(f"   main loop: {lp.n} SASS instructions per warp per iteration"
                       + (f", {self.loop_elems} weight elements per iteration -> {pe:.2f} thread instructions per "
                          f"weight element" if pe else ""))
            out.append("   main loop opcodes: " + _hist(lp.ops, top))
            out.append("   main loop classes: " + ", ".join(f"{k} {v}" for k, v in pipe_mix(lp.ops).items()))
        out.append("   whole kernel opcodes: " + _hist(self.ops, top))
        return "\n".join(out)


# Rough issue classes of sm_90 SASS opcodes (which unit an instruction occupies; a guide for reading counts, not a
# throughput model): the FMA pipe also runs IMAD (incl. IMAD.MOV / IMAD.SHL, ptxas's moves and shifts) and the
# packed half ops; F2FP / F2F / I2F conversions have their own, narrower path on recent GPUs.
_CLASSES = {
    "fma": ("FFMA", "FMUL", "FADD", "FMNMX", "IMAD", "HFMA2", "HMUL2", "HADD2", "HMNMX2", "DFMA", "IMUL", "IDP"),
    "alu": ("LOP3", "SHF", "IADD3", "PRMT", "SEL", "FSEL", "ISETP", "FSETP", "LEA", "VIADD", "IABS", "MOV", "PLOP3",
            "VIMNMX", "IMNMX", "SGXT", "LOP", "BMSK", "FLO", "POPC", "P2R", "R2P", "CS2R", "S2R", "S2UR", "BREV"),
    "conv": ("F2FP", "F2F", "I2F", "F2I", "FRND", "I2FP", "F2IP"),
    "mufu": ("MUFU",),
    "mem": ("LDS", "STS", "LDG", "STG", "LDSM", "STSM", "LDGSTS", "LDL", "STL", "ATOM", "ATOMS", "RED", "LDC", "SHFL",
            "LD", "ST", "UBLKCP", "UTMALDG", "SYNCS"),
    "mma": ("HMMA", "HGMMA", "QGMMA", "IMMA", "IGMMA"),
    "sync": ("BAR", "WARPGROUP", "MEMBAR", "FENCE", "DEPBAR", "LDGDEPBAR", "WARPSYNC", "ERRBAR", "CCTL"),
}
_CLASS_OF = {op: c for c, ops in _CLASSES.items() for op in ops}


def pipe_mix(ops: collections.Counter) -> dict:
    """Opcode counts folded into the rough classes above (uniform-datapath U* ops as "uniform")."""
    out = collections.Counter()
    for op, n in ops.items():
        out[_CLASS_OF.get(op, "uniform" if op.startswith("U") else "other")] += n
    return dict(out.most_common())


def _hist(c, top):
    return ", ".join(f"{k} {v}" for k, v in c.most_common(top))


def _occupancy(regs, warps, smem):
    """Blocks per SM on sm_90 from registers (64K per SM, allocated per warp in units of 256) and shared memory
    (228 KB per SM, 227 KB per block max, 1 KB reserved per block); also capped at 32 blocks / 64 warps."""
    if not regs:
        return "?"
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = 65536 // (per_warp * warps)
    by_smem = (233472 // (smem + 1024)) if smem else 32
    blocks = max(0, min(by_regs, by_smem, 32, 64 // warps))
    return f"{blocks} blocks = {blocks * warps} warps/SM ({100 * blocks * warps / 64:.0f} %)"


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*(?:/\*|$)")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def parse_sass(sass: str):
    """nvdisasm text -> (opcode Counter, loops). Loops: backward branches (BRA to an earlier label)."""
    instrs, labels = [], {}
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = _LINE.search(line)
        if not m:
            continue
        text = m.group(2).strip()
        if not text or text.startswith("."):
            continue
        instrs.append(text)
    ops = collections.Counter()
    opcodes = []
    for t in instrs:
        t2 = re.sub(r"^@!?U?P[T0-9]+\s+", "", t)
        op = t2.split()[0] if t2.split() else "?"
        opcodes.append(op)
        ops[op.split(".")[0]] += 1
    loops = []
    for i, t in enumerate(instrs):
        if opcodes[i].split(".")[0] != "BRA":
            continue
        m = re.search(r"`?\(?(\.L_x_\d+)\)?`?", t)
        if m and m.group(1) in labels and labels[m.group(1)] < i - 1:     # not the 1-instruction trap loop
            s = labels[m.group(1)]
            c = collections.Counter(o.split(".")[0] for o in opcodes[s:i + 1])
            loops.append(Loop(s, i, c))
    return ops, loops


def _features(ptx, ops):
    return {
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma.sync": ptx.count("mma.sync"),
        "cp.async": len(re.findall(r"cp\.async\.(?:ca|cg)", ptx)),
        "TMA": len(re.findall(r"cp\.async\.bulk", ptx)),
        "ldmatrix": ptx.count("ldmatrix"),
        "HGMMA(sass)": ops["HGMMA"],
        "HMMA(sass)": ops["HMMA"],
        "LDGSTS(sass)": ops["LDGSTS"],
    }


def _ptxas_stats(ptx, name):
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([_tool("ptxas"), "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
        log = r.stdout + r.stderr
    regs = int(m.group(1)) if (m := re.search(r"Used (\d+) registers", log)) else 0
    ss = int(m.group(1)) if (m := re.search(r"(\d+) bytes spill stores", log)) else 0
    sl = int(m.group(1)) if (m := re.search(r"(\d+) bytes spill loads", log)) else 0
    return regs, ss, sl, log


def _sass(cubin: bytes):
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        with open(p, "wb") as f:
            f.write(cubin)
        r = subprocess.run([_tool("nvdisasm"), "-c", p], capture_output=True, text=True)
        if r.returncode:
            r = subprocess.run([_tool("cuobjdump"), "-sass", p], capture_output=True, text=True)
        return r.stdout


def compile_kernel(fn, signature: dict, constexprs: dict, *, num_warps=4, num_stages=3, label="", loop_elems=0,
                   **options) -> Report:
    """Compile ``fn`` (a @triton.jit or @gluon.jit function) for sm_90. ``signature``: every non-constexpr parameter name ->
    Triton type string ("*u8", "*fp32", "i32", ...); ``constexprs``: name -> value (parameters with defaults may be
    left out). Pointers get tt.divisibility 16 (jax-triton's assumption). ``options``: other compile options
    (e.g. maxnreg=168)."""
    sig = {}
    attrs = {}
    consts = {}
    for i, p in enumerate(fn.params):
        if p.name in signature:
            sig[p.name] = signature[p.name]
            if signature[p.name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.name in constexprs:
            sig[p.name] = "constexpr"
            consts[p.name] = constexprs[p.name]
        elif p.has_default:
            sig[p.name] = "constexpr"
            consts[p.name] = p.default
        else:
            raise ValueError(f"{fn.__name__}: no type or value for parameter {p.name!r}")
    extra = set(signature) | set(constexprs)
    unknown = extra - {p.name for p in fn.params}
    if unknown:
        raise ValueError(f"{fn.__name__}: unknown parameters {sorted(unknown)}")
    from dsflash.kernels.gluon_launch import is_gluon
    if is_gluon(fn):        # a Gluon kernel is TTGIR already (kernels/gluon_launch.py)
        from triton.experimental.gluon._runtime import GluonASTSource
        src = GluonASTSource(fn, sig, consts, attrs)
    else:
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages, **options))
    ptx = k.asm["ptx"]
    regs, ss, sl, log = _ptxas_stats(ptx, k.metadata.name)
    sass = _sass(k.asm["cubin"])
    ops, loops = parse_sass(sass)
    return Report(name=k.metadata.name, num_warps=num_warps, num_stages=num_stages, regs=regs, spill_stores=ss,
                  spill_loads=sl, smem=k.metadata.shared, ptx=ptx, sass=sass, ops=ops, loops=loops,
                  features=_features(ptx, ops), ptxas_log=log, label=label, loop_elems=loop_elems)


# ------------------------------------------------------------------------------------------ MoE mode
_TRITON_TYPES = {"uint8": "u8", "uint16": "u16", "uint32": "u32", "int8": "i8", "int32": "i32", "int64": "i64", "float32": "fp32",
                 "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


class _Recorder:
    """Stand-in for ``jax_triton``: records every ``triton_call`` of the real launcher (kernel, argument dtypes,
    grid, warps, stages, constexprs) and returns shape/dtype stand-ins, so no kernel runs and no weights exist."""

    def __init__(self):
        self.calls = []

    def triton_call(self, *args, kernel, out_shape, grid, num_warps=4, num_stages=3, **kw):
        import jax
        multi = isinstance(out_shape, (tuple, list))
        shapes = tuple(out_shape) if multi else (out_shape,)
        kw.pop("zeroed_outputs", None)          # a launch option, not a kernel argument
        self.calls.append(dict(kernel=kernel, args=[_dt(a) for a in args] + [_dt(o) for o in shapes],
                               grid=tuple(grid), num_warps=num_warps, num_stages=num_stages, constexprs=kw))
        outs = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in shapes)
        return outs if multi else outs[0]


def _dt(a):
    import numpy as np
    return _TRITON_TYPES[str(np.dtype(a.dtype))]


def moe_launches(name_or_cfg, T, *, d=5120, I=2304, E=96, k=6, precision="reference"):
    """The launcher's triton_call records for a config at T tokens (V4.1 shapes by default)."""
    import jax
    import jax.numpy as jnp
    from dsflash.kernels import moe_gemm_triton as mt, moe_plan
    cfg = moe_plan.named_config(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    act_fp8 = precision == "reference"
    rec = _Recorder()
    old = sys.modules.get("jax_triton")
    sys.modules["jax_triton"] = rec
    try:
        key = jax.random.PRNGKey(0)
        x = jnp.zeros((T, d), jnp.bfloat16)
        idx = jax.lax.top_k(jax.random.gumbel(key, (T, E)), k)[1].astype(jnp.int32)
        weight = jnp.ones((T, k), jnp.float32)
        p = mt.prepare(x, idx, weight, E=E, BM=cfg.BM, act_fp8=act_fp8)
        u8 = jnp.uint8
        w1 = jax.ShapeDtypeStruct((E, I, d // 2), u8)
        s1 = jax.ShapeDtypeStruct((E, I, d // 32), u8)
        w2 = jax.ShapeDtypeStruct((E, d, I // 2), u8)
        s2 = jax.ShapeDtypeStruct((E, d, I // 32), u8)
        if cfg.kind == "sk" and cfg.mma == "swap_il":       # the load-time il layout (kernels/moe_layout.py)
            w1 = jax.ShapeDtypeStruct((E, I, d // 4), jnp.uint16)
            s1 = jax.ShapeDtypeStruct((E, I, d // 128), jnp.uint32)
            w2 = jax.ShapeDtypeStruct((E, d, I // 4), jnp.uint16)
            s2 = jax.ShapeDtypeStruct((E, d, I // 128), jnp.uint32)
        mt._launch(p, w1, s1, w1, s1, w2, s2, T=T, k=k, d=d, I=I, E=E, limit=10.0, act_fp8=act_fp8, cfg=cfg)
    finally:
        if old is None:
            sys.modules.pop("jax_triton", None)
        else:
            sys.modules["jax_triton"] = old
    return cfg, rec.calls


def _moe_loop_elems(call, cfg):
    """Weight elements one main-loop iteration consumes (MXFP4 elements of W1+W3, or W2), when known."""
    kn = call["kernel"].__name__
    c = call["constexprs"]
    if kn == "_moe_up_kernel_il" and c.get("GU"):      # split_gate_up: one of W1 / W3 a program
        return c["BN"] * c["BK"]
    if kn.startswith(("_moe_up_kernel_sw", "_moe_up_kernel_sk", "_moe_up_kernel_ps", "_moe_up_kernel_il")) \
            and cfg.mma != "fp8":
        return 2 * c["BN"] * c["BK"]
    if kn.startswith(("_moe_down_kernel_sw", "_moe_down_kernel_sk", "_moe_down_kernel_ps", "_moe_down_kernel_il")) \
            and cfg.mma != "fp8":
        return c["BN"] * c["BK"]
    if kn.startswith("_moe_up_kernel") and "KSUB" in c:
        return 2 * c["BN"] * 32 * c.get("KSUB", 1)
    if kn.startswith("_moe_down_kernel") and "KSUB" in c:
        return c["BN"] * 32 * c.get("KSUB", 1)
    return 0


def moe_reports(name_or_cfg, T, *, precision="reference", options=None, **shape):
    cfg, calls = moe_launches(name_or_cfg, T, precision=precision, **shape)
    reps = []
    for c in calls:
        fn = c["kernel"]
        names = [p.name for p in fn.params if not p.is_constexpr]
        if len(names) != len(c["args"]):
            raise RuntimeError(f"{fn.__name__}: {len(c['args'])} arrays for {len(names)} parameters {names}")
        sig = {n: "*" + t for n, t in zip(names, c["args"])}
        label = (f"{name_or_cfg if isinstance(name_or_cfg, str) else 'cfg'} T={T} {fn.__name__} grid {c['grid']} "
                 + " ".join(f"{k}={v}" for k, v in c["constexprs"].items() if k in ("BM", "BN", "BK", "KS", "EO",
                                                                                     "PREFETCH", "KSUB", "HOUT")))
        reps.append(compile_kernel(fn, sig, c["constexprs"], num_warps=c["num_warps"], num_stages=c["num_stages"],
                                   label=label, loop_elems=_moe_loop_elems(c, cfg), **(options or {})))
    return reps


def _value(s):
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("moe", help="a named moe_plan config at token counts, as the launcher compiles it")
    m.add_argument("configs", help="comma-separated names (moe_plan.named_configs())")
    m.add_argument("--tokens", default="1,16")
    m.add_argument("--precision", default="reference", choices=("reference", "bf16"))
    g = sub.add_parser("kernel", help="any @triton.jit kernel: module:function")
    g.add_argument("fn")
    g.add_argument("--sig", nargs="*", default=[], help="NAME=type for every non-constexpr parameter")
    g.add_argument("--const", nargs="*", default=[], help="NAME=value for constexpr parameters")
    g.add_argument("--warps", type=int, default=4)
    g.add_argument("--stages", type=int, default=3)
    g.add_argument("--loop-elems", type=int, default=0)
    for p in (m, g):
        p.add_argument("--maxnreg", type=int, default=None, help="compile option maxnreg (ptx .maxnreg)")
        p.add_argument("--sass", default=None, help="folder to write the SASS / PTX / ptxas log of each kernel to")
        p.add_argument("--top", type=int, default=20, help="opcodes in the histograms")
    a = ap.parse_args(argv)
    opts = {"maxnreg": a.maxnreg} if a.maxnreg else {}
    reps = []
    if a.mode == "moe":
        for name in a.configs.split(","):
            for T in (int(t) for t in a.tokens.split(",")):
                reps += moe_reports(name, T, precision=a.precision, options=opts)
    else:
        mod, fname = a.fn.split(":")
        fn = getattr(importlib.import_module(mod), fname)
        sig = dict(s.split("=", 1) for s in a.sig)
        const = {k: _value(v) for k, v in (s.split("=", 1) for s in a.const)}
        reps.append(compile_kernel(fn, sig, const, num_warps=a.warps, num_stages=a.stages, label=a.fn,
                                   loop_elems=a.loop_elems, **opts))
    for i, r in enumerate(reps):
        print(r.summary(a.top))
        if a.sass:
            os.makedirs(a.sass, exist_ok=True)
            stem = os.path.join(a.sass, f"{i:02d}_{r.name}")
            for ext, text in (("sass", r.sass), ("ptx", r.ptx), ("ptxas.log", r.ptxas_log)):
                with open(f"{stem}.{ext}", "w") as f:
                    f.write(text)
    return reps


if __name__ == "__main__":
    main()
