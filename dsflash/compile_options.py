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
A jit that is traced inside another program must stay a plain ``jax.jit``: JAX refuses ``compiler_options`` on a
nested jit (ValueError), and a nested jit is compiled as part of the outer program, with its options
(``train/loop._target_outputs_nested``).

Through here: ``forward_jit``, the ``Model``'s DSpark jits, ``bench forward``'s step programs, the engine's runner
(``serve/engine/runner.py``: prefill and decode loop, also when compiled ahead of time with ``.lower().compile()``,
which keeps the jit's options; tests/test_compile_options.py checks the bits) and every jit of ``train/``.

Process fallback (``protect_process_default``, called once by ``import dsflash``): appends
``--xla_allow_excess_precision=false`` to ``XLA_FLAGS`` unless the user chose that flag. Why it cannot go yet
(2026-12-02): programs that compute with model numerics are still compiled with a plain ``jax.jit`` --
``bench engine``'s forward / propose programs, ``bench eplb``'s routing pass (its expert ids come from a top-k that
excess precision can change), ``bench kernels``' jitted references and Triton wrappers, and any user's own
``jax.jit(dsflash.model.forward)`` (a notebook's natural first move); and tests such as test_sharding_forward,
test_model_dspark, test_sharding_ep_moe and test_kernels_moe_swiglu_rounding jit model or reference code with a plain
``jax.jit`` and judge it against bounds or bits measured under the flag
(``test_per_program_option_equals_the_process_flag_on_cpu`` relies on the flag by design). Dropping the flag
would silently change all of those on the GPU and on CPU (the tiny model's logits depend on it). To remove it: route the bench programs through ``jit`` / ``options``, give users
``forward_jit`` as the one documented way, rewrite those tests to use it, then delete the call in
``dsflash/__init__.py``.
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
