"""dsflash.compile_options: the numerics-protecting XLA option per compiled program, equivalent on CPU to the
process-wide XLA_FLAGS fallback that ``import dsflash`` still sets (the module docstring says why it stays)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash import compile_options as co


def test_options_merge():
    assert co.options() == {"xla_allow_excess_precision": False}
    assert co.options({"xla_backend_optimization_level": 0}) == {"xla_allow_excess_precision": False,
                                                                 "xla_backend_optimization_level": 0}
    assert co.options({co.FLAG: True}) == {co.FLAG: True}          # an explicit choice wins


def test_process_fallback_keeps_a_users_choice(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    co.protect_process_default()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 --xla_allow_excess_precision=false"
    monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=true")
    co.protect_process_default()
    assert os.environ["XLA_FLAGS"] == "--xla_allow_excess_precision=true"


def test_jit_forms():
    f = co.jit(lambda x: x * 2)
    g = co.jit(static_argnums=(1,))(lambda x, k: x * k)
    h = co.jit(lambda x: x + 1, compiler_options={"xla_backend_optimization_level": 0})
    assert int(f(jnp.int32(3))) == 6 and int(g(jnp.int32(3), 4)) == 12 and int(h(jnp.int32(1))) == 2


@pytest.fixture(scope="module")
def tiny_forward_inputs():
    import dsflash
    from dsflash.model.state import make_batch
    m = dsflash.load("tiny", progress=False)
    sess = m.init_state(1, 32)
    tokens = jnp.asarray(np.arange(16, 48, dtype=np.int32)[None])
    batch = make_batch(tokens, start=np.zeros(1, np.int32), lengths=np.full(1, 32, np.int32),
                       pages_per_seq=sess["pages_per_seq"])
    return m, batch, sess["state"], m.opts.replace(page_size=sess["page_size"], logits="all")


def test_per_program_option_equals_the_process_flag_on_cpu(tiny_forward_inputs):
    """The tiny forward (whose CPU logits do depend on the setting) under the process flag alone (set by ``import
    dsflash``, which the test process did first; plain ``jax.jit``), under the per-program option (``Model.logits``:
    ``forward_jit`` is compiled through ``compile_options.jit``), and with excess precision allowed for this program
    only: the first two are bit-identical, the third differs (the option is honoured per program)."""
    from dsflash.model.forward import forward
    assert "--xla_allow_excess_precision=false" in os.environ["XLA_FLAGS"]
    m, batch, state, opts = tiny_forward_inputs

    def logits(jitted):
        out, _ = jitted(m.params, m.cfg, batch, state, opts)
        return np.asarray(out["logits"])
    by_flag = logits(jax.jit(forward, static_argnums=(1, 4)))
    by_option = m.logits(np.asarray(batch.tokens))
    allowed = logits(jax.jit(forward, static_argnums=(1, 4), compiler_options={co.FLAG: True}))
    np.testing.assert_array_equal(by_option, by_flag)
    assert not np.array_equal(allowed, by_flag)


def test_ahead_of_time_compile_honours_the_per_program_option(tiny_forward_inputs):
    """The engine's runner compiles ahead of time (``jit(...).lower(...).compile()``): the option given to the jit
    reaches that compile (the opposite setting gives other bits, ``compile_options.jit`` the flag's bits)."""
    from dsflash.model.forward import forward
    m, batch, state, opts = tiny_forward_inputs

    def fwd(params, batch, state):
        return forward(params, m.cfg, batch, state, opts)[0]["logits"]

    def aot(jitted):
        return np.asarray(jitted.lower(m.params, batch, state).compile()(m.params, batch, state))
    by_flag = np.asarray(jax.jit(fwd)(m.params, batch, state))
    np.testing.assert_array_equal(aot(co.jit(fwd)), by_flag)
    assert not np.array_equal(aot(jax.jit(fwd, compiler_options={co.FLAG: True})), by_flag)


def test_runner_and_training_programs_compile_through_here(monkeypatch):
    """No plain ``jax.jit`` left in the engine's runner and the training code (but for a nested one, which takes
    its outer program's options); the runner's two programs are built by ``compile_options.jit``."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "dsflash"
    for path in [root / "serve" / "engine" / "runner.py", *sorted((root / "train").glob("*.py"))]:
        # the one exception: a jit traced inside another program (JAX refuses compiler_options there)
        plain = [ln for ln in path.read_text().splitlines() if "jax.jit(" in ln and "_nested = jax.jit(" not in ln]
        assert not plain, (path, plain)
    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.engine.testing import ToyBackend
    built = []
    real = co.jit
    # the decode programs are functools.partial(_decode_impl, drafting=...): one per compiled draft length
    name = lambda fun: getattr(getattr(fun, "func", fun), "__name__", fun)  # noqa: E731
    monkeypatch.setattr(co, "jit", lambda fun=None, **kw: built.append(name(fun)) or real(fun, **kw))
    LLMEngine(ToyBackend(), max_num_seqs=2, max_model_len=64, page_size=8, max_num_batched_tokens=32,
              decode_steps=2, compilation_cache=False)
    assert {"_prefill_impl", "_decode_impl"} <= set(built)
