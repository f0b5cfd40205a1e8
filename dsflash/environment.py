"""Every environment variable dsflash reads, and why it is one (settings are arguments and config fields; see
docs/architecture.md). A variable read anywhere under ``dsflash/`` must be listed here
(tests/test_environment.py scans the package); the test suite's own opt-ins are listed too.

Kinds: "secret" (kept out of argv, where ``ps`` shows it), "foreign" (another tool's variable, read to agree with
it), "transitional" (to become an argument / config field: the note says which), "default" (the default of a config
field / CLI flag, read only here, by the function below that the field's user calls when the field is unset),
"tooling" (test / benchmark bookkeeping that changes no result), "test" (read by tests/ only).
"""
import os

VARIABLES = {
    # name: (kind, reader, note)
    "XLA_FLAGS": ("transitional", "dsflash/compile_options.py",
                  "import dsflash appends --xla_allow_excess_precision=false unless set; goes once every program is "
                  "compiled through compile_options.jit (the runner's and train's are; that module says which are "
                  "not yet and why)"),
    "JAX_PLATFORMS": ("foreign", "dsflash/sharding/mesh.py",
                      "JAX's platform choice: a CPU-only multi-process run initialises jax.distributed for CPU"),
    "DSFLASH_API_KEY": ("secret", "dsflash/serve/__main__.py", "default of --api-key"),
    "DSFLASH_ROUTER_API_KEY": ("secret", "dsflash/serve/router.py", "default of the router's --api-key"),
    "DSFLASH_PD_SECRET": ("secret", "dsflash/serve/pd/trust.py",
                          "the shared P/D secret when neither --pd-secret-file nor --pd-secret is given"),
    "OPENAI_API_KEY": ("secret", "dsflash/bench/serve.py", "default of --api-key (the openai client's convention)"),
    "DSFLASH_CACHE_DIR": ("default", "dsflash/environment.py",
                          "default of EngineConfig.compilation_cache_dir / --compilation-cache-dir (compilation_cache_dir())"),
    "DSFLASH_COMPILE_THREADS": ("default", "dsflash/environment.py",
                                "default of EngineConfig.compile_threads / --compile-threads (compile_threads())"),
    "DSFLASH_UPDATE_GOLDEN": ("tooling", "dsflash/sharding/rules.py",
                              "rewrite tests/golden snapshots (the default of check_golden(update=None))"),
    "DSFLASH_COMMIT": ("tooling", "dsflash/bench/kernels.py",
                       "commit recorded in benchmark JSON when the device machine's git copy reports a stale HEAD"),
    "DSFLASH_INTERPRET_TESTS": ("test", "tests/test_kernels_interpret.py", "opt in to the Triton interpreter runs"),
    "DSFLASH_TEST_SERVER_URL": ("test", "tests/test_server_util.py", "drive an already running server"),
    "DSFLASH_TEST_SERVER_MODEL": ("test", "tests/test_server_util.py", "the model the real-engine server tests load"),
    "DSFLASH_TEST_SERVER_CACHE": ("test", "tests/conftest.py",
                                  "compilation cache folder of the run's default-model test servers (made if unset)"),
}


# ---------------------------------------------------------------------------------- defaults of config fields
def compilation_cache_dir() -> str:
    """Folder of the persistent XLA compilation cache when ``EngineConfig.compilation_cache_dir`` is unset:
    $DSFLASH_CACHE_DIR, else ~/.cache/dsflash/jax."""
    return os.environ.get("DSFLASH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dsflash", "jax")


def compile_threads() -> int:
    """Start-up compile threads when ``EngineConfig.compile_threads`` is unset: $DSFLASH_COMPILE_THREADS, else 1."""
    return int(os.environ.get("DSFLASH_COMPILE_THREADS", "1"))
