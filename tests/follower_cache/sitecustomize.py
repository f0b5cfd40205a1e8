"""Imported at start-up by the job processes of test_serve_multihost.py (their PYTHONPATH starts with this
folder): every process of a job writes its own persistent-cache entries, not just process 0.

JAX writes entries from process 0 only (``jax._src.compiler._cache_write``), and on CPU a follower's cache keys
differ from process 0's (the device assignment and topology are in them), so without this every job's follower
compiles the engine from scratch; with it only the module's first job does (measured: a later job's two processes
26 s of CPU to start instead of 47 s). Serving itself is untouched: a follower that loads its programs runs the
same executables it would have compiled. If JAX's private function changes, nothing is patched (slower, not
wrong)."""
try:
    import inspect
    import warnings

    from jax._src import compilation_cache, compiler, config, distributed

    _write = compiler._cache_write
    _ARGS = ["cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"]

    def _cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if (distributed.global_state.process_id == 0 or host_callbacks
                or compile_time_secs < config.persistent_cache_min_compile_time_secs.value):
            return _write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as ex:  # noqa: BLE001 -- a failed write only costs the next job a compile
            warnings.warn(f"follower cache write for {module_name!r} failed: {type(ex).__name__}: {ex}")

    if list(inspect.signature(_write).parameters) == _ARGS:
        compiler._cache_write = _cache_write
except Exception:  # noqa: BLE001 -- no JAX, or its internals moved: run unpatched
    pass
