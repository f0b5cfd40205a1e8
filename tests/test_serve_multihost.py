"""Multi-controller serving (docs/multihost.md): ``python -m dsflash.serve`` as a two-process ``jax.distributed``
job on this machine (2 CPU processes x 4 faked devices, dep=8 over both, gloo collectives), started by the test.

* the job answers greedy completions exactly as one process does (the single-device engine, fp32), and a
  SIGTERM to the leader stops both processes cleanly (status 0);
* a follower killed mid-request: the leader fails the in-flight stream with an error event that says why and
  exits with status 1, within a timeout (never hangs); a follower stopped (SIGSTOP) trips --step-timeout the same
  way;
* bad flags fail at start-up naming the flag; the plan encoding round-trips; the watchdog fires.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from test_server_util import REPO, communicate_all, free_port, wait_healthy

ENGINE = dict(max_num_seqs=8, max_model_len=64, page_size=16, max_num_batched_tokens=64, precision="fp32",
              speculative=False)
ARGS = ["--model", "tiny", "--mesh", "dep=8", "--replicate-draft-experts", "--precision", "fp32",
        "--no-speculative", "--max-num-seqs", "8", "--max-model-len", "64", "--page-size", "16",
        "--max-num-batched-tokens", "64"]
PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 5], [100, 200, 300, 400, 17, 18, 19]]
# a job compiles the engine's programs in every process: ~45-75 s on an idle 2-core machine, up to ~180 s measured
# while other jobs loaded it (load average 6); later jobs load them from the module's cache (follower_cache/)
STARTUP_TIMEOUT = 400.0


@pytest.fixture(scope="module")
def plain_env():
    """4 faked CPU devices per process (the processes' environment, without the cache hook of ``job_env``)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def job_env(plain_env, tmp_path_factory):
    """The job processes' environment: one persistent compilation cache for the module (conftest.py turns it off
    for the test process), which followers write too (follower_cache/sitecustomize.py: JAX writes from process 0
    only), so only the module's first job compiles."""
    return dict(plain_env, JAX_ENABLE_COMPILATION_CACHE="true",
                DSFLASH_CACHE_DIR=str(tmp_path_factory.mktemp("xla_cache")),
                PYTHONPATH=os.path.join(REPO, "tests", "follower_cache") + os.pathsep + plain_env["PYTHONPATH"])


@pytest.fixture(scope="module")
def reference():
    """Greedy (text, token count) of each prompt from one process on one device, same engine settings, as a future:
    computed on a thread of the test process from when a test first asks, so that its compile overlaps the job's
    serving (a job's step mostly waits on gloo round trips, leaving a core idle)."""
    def run():
        import dsflash
        from dsflash.serve.types import SamplingParams
        ref = dsflash.LLM("tiny", **ENGINE)
        outs = ref.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
        return [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outs]
    with ThreadPoolExecutor(1) as ex:
        yield ex.submit(run)


class Job:
    """``n`` processes of ``python -m dsflash.serve`` joined through ``--coordinator``; process 0 serves HTTP."""

    def __init__(self, env, tmp_path, n=2, extra=()):
        self.port, coord = free_port(), f"127.0.0.1:{free_port()}"
        self.base = f"http://127.0.0.1:{self.port}"
        self.logs = [open(tmp_path / f"process{i}.log", "w+") for i in range(n)]
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "dsflash.serve", *ARGS, *extra, "--port", str(self.port), "--coordinator", coord,
             "--num-processes", str(n), "--process-id", str(i)],
            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT) for i, log in enumerate(self.logs)]
        self.t0 = time.time()

    def output(self, i=0) -> str:
        self.logs[i].flush()
        with open(self.logs[i].name, encoding="utf-8", errors="replace") as f:
            return "".join(ln for ln in f if "[Gloo]" not in ln)[-6000:]

    def wait_healthy(self, timeout=None):
        timeout = STARTUP_TIMEOUT if timeout is None else timeout
        wait_healthy(self.base, timeout, self.procs[0], "leader", lambda: self.output(0) + self.output(1))
        self.startup_s = time.time() - self.t0

    def wait(self, timeout) -> list:
        t_end = time.time() + timeout
        for p in self.procs:
            p.wait(max(0.1, t_end - time.time()))
        return [p.returncode for p in self.procs]

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _complete(base, prompt, max_tokens=8):
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()
    return c["choices"][0]["text"], c["usage"]["completion_tokens"]


def test_two_processes_serve_like_one_and_stop_cleanly(job_env, tmp_path, request):
    # first in the module: its job fills the compilation cache the later jobs load from
    job = Job(job_env, tmp_path)
    try:
        job.wait_healthy()
        ref = request.getfixturevalue("reference")       # compiles while the job serves (not while it compiles)
        got = [_complete(job.base, p) for p in PROMPTS]
        # concurrent requests batch together across the processes' devices: the same answers
        with ThreadPoolExecutor(3) as ex:
            together = list(ex.map(lambda p: _complete(job.base, p), PROMPTS))
        want = ref.result()
        assert got == want, (got, want)
        assert together == want, (together, want)
        assert "follower ready" in job.output(1) and "listening on" in job.output(0)
        job.procs[0].send_signal(signal.SIGTERM)           # the leader stops its followers on the way out
        rcs = job.wait(60)
        assert rcs == [0, 0], (rcs, job.output(0), job.output(1))
        assert "the leader stopped after" in job.output(1)
        print(f"\n[multihost] 2-process job up in {job.startup_s:.1f}s")
    finally:
        job.kill()


def test_dead_follower_fails_requests_and_the_leader_exits(job_env, tmp_path):
    job = Job(job_env, tmp_path)
    try:
        job.wait_healthy()
        events, t_kill = [], None
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 56, "temperature": 0, "stream": True}
        with httpx.stream("POST", job.base + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if t_kill is None:                          # mid-request: the first chunk is out
                    job.procs[1].kill()
                    t_kill = time.time()
        assert t_kill is not None, events
        errors = [json.loads(e)["error"]["message"] for e in events if e != "[DONE]" and '"error"' in e]
        print(f"\n[multihost] the stream's error event: {errors[:1]}")
        assert errors and "multi-controller step" in errors[0] and "process of the job is gone" in errors[0], events
        rc = job.procs[0].wait(60)                          # never hangs
        assert rc == 1, (rc, job.output(0))
        assert "FollowerLostError" in job.output(0) or "multi-controller" in job.output(0)
        print(f"\n[multihost] job up in {job.startup_s:.1f}s; leader failed the stream and exited "
              f"{time.time() - t_kill:.1f}s after the kill")
    finally:
        job.kill()


def test_stuck_follower_trips_the_step_timeout(job_env, tmp_path):
    """A follower that stops answering without dying (SIGSTOP: its sockets stay open, so no collective fails):
    the leader's watchdog fails the stream after --step-timeout and the leader exits with status 1."""
    job = Job(job_env, tmp_path, extra=("--step-timeout", "8"))
    try:
        job.wait_healthy()
        events, t_stop = [], None
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 56, "temperature": 0, "stream": True}
        with httpx.stream("POST", job.base + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if t_stop is None:
                        job.procs[1].send_signal(signal.SIGSTOP)
                        t_stop = time.time()
        errors = [json.loads(e)["error"]["message"] for e in events if e != "[DONE]" and '"error"' in e]
        assert errors and "--step-timeout" in errors[0], events
        assert job.procs[0].wait(60) == 1, job.output(0)
        print(f"\n[multihost] job up in {job.startup_s:.1f}s; stuck follower: leader exited "
              f"{time.time() - t_stop:.1f}s after SIGSTOP")
    finally:
        job.kill()


def llm_child(port: int, pid: int) -> None:
    """One process of a two-process ``dsflash.LLM`` job (the same script on both): the leader generates and
    prints the outputs as JSON, the follower follows."""
    import dsflash
    from dsflash.serve.types import SamplingParams
    from dsflash.sharding.rules import get_strategy
    llm = dsflash.LLM("tiny", coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid, mesh="dep=8",
                      load_options={"strategy": get_strategy("dep", draft_expert_parallel=False)}, **ENGINE)
    if llm.is_leader:
        with llm:
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
        print(json.dumps({"out": [[o.outputs[0].text, len(o.outputs[0].token_ids)] for o in outs],
                          "compiles": llm.engine.compiles_after_warmup}), flush=True)
    else:
        with pytest.raises(RuntimeError, match="follower"):
            llm.generate(PROMPTS[:1])
        print(json.dumps({"steps": llm.follow()}), flush=True)


def test_llm_across_two_processes(job_env, request):
    """``dsflash.LLM(coordinator=..., num_processes=2, process_id=i, mesh="dep=8")``: process 0 generates the
    single-device engine's greedy outputs, process 1 follows until process 0 closes."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--llm-child", str(port), str(i)],
                              env=job_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    want = [list(w) for w in request.getfixturevalue("reference").result()]
    outs = communicate_all(procs, STARTUP_TIMEOUT)
    for rc, o, e in outs:
        assert rc == 0, e[-3000:]
    lead, follow = (json.loads(o.strip().splitlines()[-1]) for _, o, _ in outs)
    assert lead["out"] == want and lead["compiles"] == 0
    assert follow["steps"] > 0


@pytest.mark.parametrize("flags, needle", [
    (["--num-processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1234"], "--process-id"),
    (["--num-processes", "0"], "--num-processes"),
    (["--coordinator", "nohostport", "--num-processes", "2", "--process-id", "0"], "--coordinator"),
    (["--num-processes", "2", "--process-id", "1"], "--coordinator"),
])
def test_bad_multihost_flags_fail_at_startup_naming_the_flag(plain_env, flags, needle):
    r = subprocess.run([sys.executable, "-m", "dsflash.serve", "--model", "tiny", "--port", "0", *flags],
                       env=plain_env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert needle in r.stderr and "error:" in r.stderr, r.stderr[-2000:]


def test_importing_the_server_does_not_start_the_backend(plain_env):
    """jax.distributed.initialize must come before any JAX backend use: importing dsflash must not start it."""
    code = ("from jax._src import xla_bridge as xb\nimport dsflash, dsflash.llm, dsflash.serve.__main__\n"
            "import dsflash.serve.http.app\nprint(bool(xb._backends))")
    r = subprocess.run([sys.executable, "-c", code], env=plain_env, cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr[-2000:]


def test_plan_encoding_round_trips():
    """What the leader broadcasts is what the follower rebuilds (from the runner's own templates)."""
    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.engine import multihost as MH
    from dsflash.serve.engine.testing import ToyBackend
    eng = LLMEngine(ToyBackend(), max_num_seqs=4, max_model_len=64, page_size=8, max_num_batched_tokens=32,
                    speculative=False)
    run = eng.runner
    rng = np.random.default_rng(0)
    pf = run.empty_prefill_inputs(run.prefill_buckets[0])
    dc = run.empty_decode_inputs()
    for tree in (pf, dc):
        for k, v in list(tree.items()):
            if k == "mask":
                continue
            if isinstance(v, dict):
                for f, a in v.items():
                    v[f] = rng.integers(0, 7, a.shape).astype(a.dtype)
            else:
                tree[k] = (rng.integers(0, 7, np.shape(v)).astype(np.asarray(v).dtype))
    dc["mask"] = rng.integers(-2**31, 2**31 - 1, dc["mask"].shape, dtype=np.int64).astype(np.int32)
    for tree, guided in ((pf, False), (dc, True)):
        words = MH._encode(tree, guided)
        tmpl = run.empty_prefill_inputs(run.prefill_buckets[0]) if tree is pf else run.empty_decode_inputs()
        assert words.size == MH._nwords(tmpl, guided)
        padded = MH._padded(words)                           # what goes on the wire: a power-of-two length
        assert padded.size == MH.padded_words(words.size) >= words.size and padded.size & (padded.size - 1) == 0
        back = MH._decode(padded, tmpl, guided)
        flat_a, tdef_a = MH._leaves(tree)
        flat_b, tdef_b = MH._leaves(back)
        assert tdef_a == tdef_b
        for a, b in zip(flat_a, flat_b):
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()


def test_watchdog_fires_once_on_a_stuck_step():
    from dsflash.serve.engine.multihost import FollowerLostError, Watchdog
    fired = []
    w = Watchdog(0.3, fired.append, poll_s=0.05)
    w.step_started()
    w.step_finished()
    time.sleep(0.5)
    assert not fired                       # a finished step is not a lost follower
    w.step_started()
    time.sleep(0.8)
    w.close()
    assert len(fired) == 1 and isinstance(fired[0], FollowerLostError) and "--step-timeout" in str(fired[0])


if __name__ == "__main__" and "--llm-child" in sys.argv:
    llm_child(int(sys.argv[2]), int(sys.argv[3]))
