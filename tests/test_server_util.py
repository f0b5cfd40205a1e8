"""Helpers for the server tests: start the real ``python -m dsflash.serve`` process on a free loopback
port, wait for ``/health``, read ``/metrics``, stop it. (No tests here; the test modules import it.)"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_test_model() -> str:
    """The model the real-engine server tests use: ``$DSFLASH_TEST_SERVER_MODEL``, else the built-in
    default (``demo``, the trained model that ships with dsflash) when the engine can load it, else the model-free ``dummy`` engine (reported)."""
    env = os.environ.get("DSFLASH_TEST_SERVER_MODEL")
    if env:
        return env
    try:
        import dsflash
        from dsflash.serve.engine import LLMEngine  # noqa: F401
        if hasattr(dsflash, "load"):
            return "demo"
    except Exception:  # noqa: BLE001
        pass
    return "dummy"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, timeout: float, proc: subprocess.Popen | None = None, name: str = "server",
                 output=lambda: "") -> None:
    """Poll ``base/health`` until it answers 200; raise if ``proc`` exits first or ``timeout`` s pass
    (with ``output()``, the process's log, in the message)."""
    t_end = time.time() + timeout
    while time.time() < t_end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{output()}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{name} not healthy after {timeout}s:\n{output()}")


class ServerProcess:
    """``python -m <module> --port <free port> *args`` on loopback, output to a temporary log. Waits until
    healthy unless ``startup_timeout`` is None (then call :meth:`wait_healthy`, e.g. after starting others).
    ``extra_env``: variables set for the server on top of the test process's."""

    def __init__(self, *args: str, startup_timeout: float | None = 300.0, module: str = "dsflash.serve",
                 name: str = "server", extra_env: dict | None = None):
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"dsflash-{name}-", suffix=".log", delete=False)
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)          # the test process fakes 8 devices; the server needs one
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        env.update(extra_env or {})
        self.cmd = [sys.executable, "-m", module, "--port", str(self.port), *args]
        self.t0 = time.time()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        if startup_timeout is not None:
            self.wait_healthy(startup_timeout)

    def wait_healthy(self, timeout: float = 300.0) -> "ServerProcess":
        """Wait for ``/health`` (killing the process if it does not come up); returns self."""
        try:
            wait_healthy(self.base, timeout, self.proc, self.name, self.output)
        except BaseException:
            self.kill()
            raise
        self.startup_s = time.time() - self.t0
        print(f"\n[{self.name}] {' '.join(self.cmd[1:])} up in {self.startup_s:.1f}s", flush=True)
        return self

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-20000:]

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics as {name: value} (labelled ones keyed with their labels)."""
        text = httpx.get(self.base + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([^\s]+)\s+([-+0-9.eEinfNa]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_metric(self, name: str, pred, timeout: float = 20.0) -> float:
        t_end = time.time() + timeout
        val = None
        while time.time() < t_end:
            val = self.metrics().get(name)
            if val is not None and pred(val):
                return val
            time.sleep(0.2)
        raise AssertionError(f"metric {name} = {val} did not reach the expected value in {timeout}s")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.terminate(30)
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


class ExistingServer(ServerProcess):
    """A server someone else started (``$DSFLASH_TEST_SERVER_URL``, e.g. on a GPU machine): same
    interface, but nothing is started or stopped."""

    def __init__(self, base: str):
        self.base = base.rstrip("/")
        self.proc = None
        self.startup_s = 0.0
        wait_healthy(self.base, 60, name=self.base)

    def output(self) -> str:
        return ""

    def terminate(self, timeout: float = 60.0) -> int:
        return 0

    def kill(self) -> None:
        pass

    def close(self) -> None:
        pass


def start_server(*args: str) -> ServerProcess:
    """The real-engine server of a test module (``$DSFLASH_TEST_SERVER_URL`` instead when set), with the run's shared
    persistent compilation cache (``$DSFLASH_TEST_SERVER_CACHE``, made by conftest.py; conftest.py turns the cache
    off for everything else): several modules start the same default server, and only the first compiles."""
    url = os.environ.get("DSFLASH_TEST_SERVER_URL")
    if url:
        return ExistingServer(url)
    return ServerProcess(*args, extra_env=shared_cache_env())


def shared_cache_env() -> dict | None:
    """The server environment that reads and fills the run's shared compilation cache (None: no cache made)."""
    cache = os.environ.get("DSFLASH_TEST_SERVER_CACHE")
    return {"JAX_ENABLE_COMPILATION_CACHE": "true", "DSFLASH_CACHE_DIR": cache} if cache else None


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    return err


def communicate_all(procs, timeout: float) -> list:
    """[(returncode, stdout, stderr)] of each process in turn (``timeout`` seconds each); any still running after
    (a timeout, an error) is killed."""
    outs = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            outs.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs
