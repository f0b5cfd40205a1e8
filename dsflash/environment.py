"""Every environment variable dsflash reads, and why it is one (settings are arguments and config fields; see
docs/architecture.md). A variable read anywhere under ``dsflash/`` must be listed here
(tests/test_environment.py scans the package); the test suite's own opt-ins are listed too.

Kinds: "secret" (kept out of argv, where ``ps`` shows it), "foreign" (another tool's variable, read to agree with
it), "transitional" (to become an argument / config field: the note says which), "tooling" (test / benchmark
bookkeeping that changes no result), "test" (read by tests/ only).
"""
VARIABLES = {
    # name: (kind, reader, note)
    "XLA_FLAGS": ("transitional", "dsflash/compile_options.py",
                  "import dsflash appends --xla_allow_excess_precision=false unless set; goes once every program is "
                  "compiled through compile_options.jit (that module says which are not yet)"),
    "JAX_PLATFORMS": ("foreign", "dsflash/sharding/mesh.py",
                      "JAX's platform choice: a CPU-only multi-process run initialises jax.distributed for CPU"),
    "DSFLASH_API_KEY": ("secret", "dsflash/serve/__main__.py", "default of --api-key"),
    "DSFLASH_ROUTER_API_KEY": ("secret", "dsflash/serve/router.py", "default of the router's --api-key"),
    "DSFLASH_PD_SECRET": ("secret", "dsflash/serve/pd/trust.py",
                          "the shared P/D secret when neither --pd-secret-file nor --pd-secret is given"),
    "OPENAI_API_KEY": ("secret", "dsflash/bench/serve.py", "default of --api-key (the openai client's convention)"),
    "DSFLASH_CACHE_DIR": ("transitional", "dsflash/serve/engine/runner.py",
                          "persistent compilation cache folder: to become an EngineConfig field (serve/ owner)"),
    "DSFLASH_COMPILE_THREADS": ("transitional", "dsflash/serve/engine/runner.py",
                                "start-up compile threads: to become an EngineConfig field (serve/ owner)"),
    "DSFLASH_UPDATE_GOLDEN": ("tooling", "dsflash/sharding/rules.py",
                              "rewrite tests/golden snapshots (the default of check_golden(update=None))"),
    "DSFLASH_COMMIT": ("tooling", "dsflash/bench/kernels.py",
                       "commit recorded in benchmark JSON when the device machine's git copy reports a stale HEAD"),
    "DSFLASH_INTERPRET_TESTS": ("test", "tests/test_kernels_interpret.py", "opt in to the Triton interpreter runs"),
    "DSFLASH_TEST_SERVER_URL": ("test", "tests/test_server_util.py", "drive an already running server"),
    "DSFLASH_TEST_SERVER_MODEL": ("test", "tests/test_server_util.py", "the model the real-engine server tests load"),
}
