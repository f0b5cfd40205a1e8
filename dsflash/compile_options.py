"""XLA compiler options that protect dsflash's numerics, per compiled program; and the one place where the
process-wide fallback (an edit of ``XLA_FLAGS``) lives until every program is compiled through here.

Why: XLA may keep values in higher precision than the program says ("excess precision") and then drops the
FP8 / FP4 quantise-dequantise round trips and bf16 roundings that define the released numerics (H200: a jitted MoE
differed from op-by-op by ~5 %; CPU: the tiny model's logits change too). ``FAITHFUL`` turns that off.

Per program (what to use):
  jit(fun, **jax_jit_kwargs)   ``jax.jit`` with ``FAITHFUL`` merged under any ``compiler_options`` given
  options(extra=None)          ``FAITHFUL`` plus ``extra`` (for ``jax.jit(...).lower(...).compile(options(...))``)
A per-program option holds whatever ``XLA_FLAGS`` says and whenever JAX's backend started (the flag only works
if ``dsflash`` is imported before JAX initialises its backend). Checked on CPU (tests/test_compile_options.py): the
tiny model's forward compiled with ``FAITHFUL`` gives the same bits as under the process flag, and the opposite
per-program setting gives different bits, so the option is honoured per program both ways.

Process fallback (``protect_process_default``, called once by ``import dsflash``): appends
``--xla_allow_excess_precision=false`` to ``XLA_FLAGS`` unless the user chose that flag. It stays, documented here,
because programs are still compiled outside this module: the engine's runner (``serve/engine/runner.py``), the
training loop (``train/loop.py``), ``bench kernels`` / ``eplb`` / ``engine`` and any user's own
``jax.jit(dsflash.model.forward)``. Through here already: ``forward_jit``, the ``Model``'s DSpark jits and
``bench forward``'s step programs. Dropping it
before they use ``jit`` / ``options`` would silently change their numerics on the GPU. To remove it: route those
jits through here, then delete the call in ``dsflash/__init__.py`` (tests/test_compile_options.py keeps holding).
"""
from __future__ import annotations

import os

FLAG = "xla_allow_excess_precision"
FAITHFUL = {FLAG: False}


def options(extra: dict | None = None) -> dict:
    """``FAITHFUL`` with ``extra`` on top (an explicit ``xla_allow_excess_precision`` in ``extra`` wins)."""
    return {**FAITHFUL, **(extra or {})}


def jit(fun=None, **kw):
    """``jax.jit(fun, **kw)`` compiling with ``options(kw["compiler_options"])``; usable as a decorator (with or
    without keyword arguments)."""
    import jax
    kw["compiler_options"] = options(kw.get("compiler_options"))
    if fun is None:
        return lambda f: jax.jit(f, **kw)
    return jax.jit(fun, **kw)


def protect_process_default() -> None:
    """The transitional process-wide fallback (module docstring): XLA reads ``XLA_FLAGS`` when its backend
    starts, so this only takes effect if it runs before that."""
    flags = os.environ.get("XLA_FLAGS", "")
    if FLAG not in flags:
        os.environ["XLA_FLAGS"] = (flags + f" --{FLAG}=false").strip()
