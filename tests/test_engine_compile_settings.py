"""The engine's compile settings are config fields with CLI flags (issue 20 item 5): ``compilation_cache_dir`` and
``compile_threads`` reach the runner from ``EngineConfig``, ``python -m dsflash.serve`` and ``bench engine`` parse
them by field name, and the environment variables are only their defaults, read in ``dsflash/environment.py``."""
import types

import pytest

from dsflash import environment
from dsflash.serve.engine import EngineConfig, LLMEngine
from dsflash.serve.engine import runner as R
from dsflash.serve.engine.testing import ToyBackend

SMALL = dict(max_num_seqs=2, max_model_len=64, page_size=8, max_num_batched_tokens=32, decode_steps=2)


def test_config_fields_reach_the_runner(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(R, "enable_compilation_cache", lambda path=None: seen.setdefault("cache_dir", path))
    warmup = R.Runner.warmup

    def recording_warmup(self, threads=None, **kw):
        seen["threads"] = threads
        return warmup(self, threads, **kw)

    monkeypatch.setattr(R.Runner, "warmup", recording_warmup)
    LLMEngine(ToyBackend(), compilation_cache_dir=str(tmp_path), compile_threads=3, **SMALL)
    assert seen == {"cache_dir": str(tmp_path), "threads": 3}
    seen.clear()
    LLMEngine(ToyBackend(), compilation_cache=False, **SMALL)          # no cache asked: none enabled
    assert seen == {"threads": None}


def test_enable_compilation_cache_uses_the_path_or_the_environment_default(monkeypatch, tmp_path):
    updates = {}
    fake_config = types.SimpleNamespace(jax_compilation_cache_dir=None, update=lambda k, v: updates.__setitem__(k, v))
    monkeypatch.setattr(R, "jax", types.SimpleNamespace(config=fake_config))     # leave JAX's real cache alone
    R.enable_compilation_cache(tmp_path / "given")
    assert updates["jax_compilation_cache_dir"] == str(tmp_path / "given") and (tmp_path / "given").is_dir()
    monkeypatch.setenv("DSFLASH_CACHE_DIR", str(tmp_path / "env"))
    R.enable_compilation_cache()
    assert updates["jax_compilation_cache_dir"] == str(tmp_path / "env")
    fake_config.jax_compilation_cache_dir = "/users/own"                 # the user's JAX setting wins
    updates.clear()
    R.enable_compilation_cache(tmp_path / "other")
    assert updates == {}


def test_environment_defaults(monkeypatch):
    monkeypatch.delenv("DSFLASH_COMPILE_THREADS", raising=False)
    monkeypatch.delenv("DSFLASH_CACHE_DIR", raising=False)
    assert environment.compile_threads() == 1
    assert environment.compilation_cache_dir().endswith("/.cache/dsflash/jax")
    monkeypatch.setenv("DSFLASH_COMPILE_THREADS", "5")
    monkeypatch.setenv("DSFLASH_CACHE_DIR", "/tmp/somewhere")
    assert environment.compile_threads() == 5 and environment.compilation_cache_dir() == "/tmp/somewhere"


def test_bad_values_name_the_field():
    for kw, field in ((dict(compile_threads=0), "compile_threads"), (dict(compile_threads=1.5), "compile_threads"),
                      (dict(compilation_cache_dir=3), "compilation_cache_dir")):
        with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
            EngineConfig(**kw)


def test_serve_flags_become_config_fields():
    from dsflash.serve.__main__ import build_parser
    args = build_parser().parse_args(["--compile-threads", "4", "--compilation-cache-dir", "/x/cache"])
    c = EngineConfig.from_namespace(args)
    assert (c.compile_threads, c.compilation_cache_dir) == (4, "/x/cache")
    c = EngineConfig.from_namespace(build_parser().parse_args([]))
    assert (c.compile_threads, c.compilation_cache_dir) == (None, None)


def test_serve_background_compile_flag():
    from dsflash.serve.__main__ import build_parser
    assert EngineConfig.from_namespace(build_parser().parse_args([])).background_compile is True
    args = build_parser().parse_args(["--no-background-compile"])
    assert EngineConfig.from_namespace(args).background_compile is False


def test_bench_engine_flags():
    from dsflash.bench import engine as bench_engine
    a = bench_engine.parse(["--compile-threads", "2", "--compilation-cache-dir", "/y"])
    assert (a.compile_threads, a.compilation_cache_dir) == (2, "/y")
    a = bench_engine.parse([])
    assert (a.compile_threads, a.compilation_cache_dir) == (None, None)


def test_server_flag_reaches_the_adaptive_policy_s_mixed_step_rule():
    """``--speculative-in-mixed-steps`` is the config field of the same name, on by default (session 28's A/B) in
    the server and in ``EngineConfig`` alike; ``--no-speculative-in-mixed-steps`` turns the prefill-first rule on."""
    from dsflash.serve.__main__ import build_parser
    assert EngineConfig.from_namespace(build_parser().parse_args([])).speculative_in_mixed_steps is True
    assert EngineConfig().speculative_in_mixed_steps is True
    c = EngineConfig.from_namespace(build_parser().parse_args(["--no-speculative-in-mixed-steps"]))
    assert c.speculative_in_mixed_steps is False
