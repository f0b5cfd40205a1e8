"""``python -m dsflash.serve``: the OpenAI-compatible server.

With no arguments it serves the built-in default model on the CPU at http://127.0.0.1:8000/v1.
``python -m dsflash.serve --help`` lists every option; ``docs/server.md`` has the details.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time

DEFAULT_MODEL = "demo"


def _size(text: str) -> int:
    """Bytes from '123', '256K', '256M', '2G' (powers of 1024)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dsflash.serve",
        description="OpenAI-compatible HTTP server for DeepSeek-V4.1-Flash (dsflash). Endpoints: "
                    "POST /v1/completions, POST /v1/chat/completions (SSE with stream=true), GET /v1/models, "
                    "GET /health, GET /metrics (Prometheus). With no arguments: the built-in default model on "
                    "the CPU at http://127.0.0.1:8000/v1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="'demo' (the trained demo model that ships with dsflash), a preset name (e.g. 'tiny', 'v41_flash': random weights), a checkpoint folder in the official Hugging "
                        "Face layout, or 'dummy' (no model: random tokens, for testing the HTTP layer)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the engine's model name)")
    g.add_argument("--mesh", default=None,
                   help="device mesh spec passed to the engine, e.g. 'dep=2', 'dep=8,tp=2' (default: one device)")
    g.add_argument("--replicate-draft-experts", action="store_true",
                   help="with --mesh: keep the DSpark draft's routed experts whole on every device (a data-parallel "
                        "draft MoE) instead of expert-parallel; needed when the draft's experts do not divide the "
                        "EP group (the demo / tiny models' 4 draft experts on dep=8)")
    g.add_argument("--max-model-len", type=int, default=2048,
                   help="longest sequence (prompt + completion) in tokens; longer requests get HTTP 400")
    g.add_argument("--max-num-seqs", type=int, default=16, help="most sequences decoded together in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=256, help="token budget of one engine step")
    g.add_argument("--max-mixed-prefill-tokens", type=int, default=None,
                   help="cap the prefill tokens of a step that also decodes (TPOT under long prompts; compiles two "
                        "smaller prefill programs; outputs then depend on the load: docs/engine.md). Default: no cap")
    g.add_argument("--num-pages", type=int, default=None, help="KV pages in the pool (default: the engine's choice)")
    g.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    g.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=True,
                   help="DSpark speculative decoding (draft 5, verify 6); --no-speculative = --speculative-mode off")
    g.add_argument("--speculative-mode", default="adaptive", choices=["adaptive", "always", "off"],
                   help="'adaptive': each decode call drafts only when the measured verify / plain cost and the "
                        "requests' running acceptance say it pays (a request whose drafts keep failing stops "
                        "drafting); 'always': every call drafts; 'off': never")
    g.add_argument("--speculative-in-mixed-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="adaptive: let the cost model also decide the decode calls of steps that prefill prompts, "
                        "where the token budget has room for both (default on; --no-speculative-in-mixed-steps: "
                        "those calls run plain; docs/engine.md 'prefill first')")
    g.add_argument("--precision", default="reference", choices=["reference", "bf16", "fp32"],
                   help="numerics: 'reference' = the official FP8/FP4 round trips, 'bf16' = plain bf16")
    g.add_argument("--backend", default="auto", choices=["auto", "xla", "triton"],
                   help="kernels of the compiled programs: 'auto' = Triton on a CUDA GPU when jax-triton "
                        "imports, else XLA; 'xla' = the pure-JAX references; 'triton' = the GPU kernels")
    g.add_argument("--moe-weight-layout", default="auto", choices=["auto", "checkpoint", "il"],
                   help="routed-expert weights as stored ('checkpoint'), or repacked once at load into the layout the "
                        "Triton MoE decode reads with half the instructions ('il': single device, bit-identical "
                        "outputs); 'auto' = 'il' on the Triton backend on one device without EPLB")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="run without the model's tokenizer: prompts must be token ids, outputs carry token_ids")
    g.add_argument("--seed", type=int, default=0, help="engine seed (weights of presets, unseeded sampling)")
    # prefix cache (docs/server.md "Prefix caching")
    g.add_argument("--prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV of prompt prefixes seen before (usage.prompt_tokens_details."
                                      "cached_tokens)")
    g.add_argument("--prefix-cache-mode", default="exact", choices=["exact", "replay"],
                   help="'exact': a hit restores the window state kept at the block boundary and answers exactly "
                        "as a miss; 'replay': a hit rebuilds it by the approximate one-window replay (SPEC 6.1)")
    g.add_argument("--prefix-snapshot-bytes", type=_size, default=256 * 2**20,
                   help="device memory for the exact mode's state snapshots (e.g. 268435456, 256M, 1G; 0 = none: "
                        "every hit replays)")
    g.add_argument("--compilation-cache-dir", default=None,
                   help="folder of the persistent XLA compilation cache (default: $DSFLASH_CACHE_DIR, else "
                        "~/.cache/dsflash/jax; JAX's own jax_compilation_cache_dir wins when set)")
    g.add_argument("--compile-threads", type=int, default=None,
                   help="threads compiling the engine's programs at start-up (default: $DSFLASH_COMPILE_THREADS, "
                        "else 1)")
    g.add_argument("--background-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="adaptive speculation: serve once the prefill and plain decode programs are compiled and "
                        "compile the drafting / tap-free programs in the background (decode calls run plain until "
                        "they are ready); --no-background-compile: compile every program before serving")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free port; the chosen one is printed)")
    s.add_argument("--api-key", default=os.environ.get("DSFLASH_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1/* (wrong or missing -> 401); "
                        "default: $DSFLASH_API_KEY, else no authentication")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds to let in-flight requests finish before aborting them")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level of the server and uvicorn")
    # --- request hardening (issue 21): body limit, tokenizer pool ---
    s.add_argument("--max-request-body-bytes", type=int, default=32 << 20,
                   help="largest request body in bytes; a larger one gets HTTP 413 while it is being read")
    s.add_argument("--tokenizer-threads", type=int, default=2,
                   help="threads that tokenise prompts and render chats off the event loop")
    s.add_argument("--special-tokens-in-content", default="control", choices=["control", "text"],
                   help="special-token text inside chat messages/tools (e.g. '<｜end▁of▁sentence｜>'): 'control' = "
                        "control tokens, as vLLM/SGLang/HF chat templates do; 'text' = plain text, so user text can "
                        "never end a turn or forge one (set it for untrusted end users; docs/server.md)")
    # --- end request hardening ---
    from dsflash.serve.pd.cli import add_cli_arguments
    add_cli_arguments(p)          # --role prefill|decode|both and the P/D options (docs/pd.md)
    from dsflash.serve import multihost_cli
    multihost_cli.add_cli_arguments(p)   # --coordinator / --num-processes / --process-id (docs/multihost.md)
    return p


def make_engine_factory(args):
    """A zero-argument callable building the engine (called in the engine thread)."""
    if args.model == "dummy":
        def factory():
            from dsflash.serve.http.dummy_engine import DummyEngine
            return DummyEngine("dummy", max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                               seed=args.seed)
        return factory

    def factory():
        from dsflash.serve.engine import EngineConfig, LLMEngine
        over = {}
        if getattr(args, "replicate_draft_experts", False):
            from dsflash.sharding.rules import get_strategy
            over["load_options"] = {"strategy": get_strategy("dep", draft_expert_parallel=False)}
        config = EngineConfig.from_namespace(args, mesh=args.mesh or None, **over)   # every option named like a field
        if getattr(args, "role", "both") != "both":
            from dsflash.serve.pd.engine import PDEngine
            return PDEngine(args.model, config, pd_role=args.role, pd_ttl=args.kv_ttl)
        return LLMEngine(args.model, config)
    return factory


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _listen(host: str, port: int) -> tuple[socket.socket, str] | None:
    """``_bind`` and the bound base URL (``http://host:port``; port 0 resolved); on failure say why on
    stderr and return None (the caller exits with status 1)."""
    try:
        sock = _bind(host, port)
    except OSError as e:
        print(f"error: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return None
    host, port = sock.getsockname()[:2]
    return sock, f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def _exit_now(status: int):
    """End a process of a broken multi-controller job now: a normal exit would wait at jax.distributed's shutdown
    barrier for the peers that are gone (minutes)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _follow(args) -> int:
    """A follower process of a multi-controller job: the same engine, no HTTP; runs the leader's steps until
    the leader stops (status 0) or the job breaks (status 1, without waiting on the lost peers)."""
    import jax
    pid = jax.process_index()
    print(f"dsflash.serve: process {pid} of {jax.process_count()}: follower; loading model {args.model!r} "
          f"(mesh={args.mesh}) ...", flush=True)
    try:
        engine = make_engine_factory(args)()
        print(f"dsflash.serve: process {pid}: follower ready; following process 0", flush=True)
        steps = engine.follow()
    except Exception as e:  # noqa: BLE001
        print(f"error: follower {pid}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        _exit_now(1)
    print(f"dsflash.serve: process {pid}: the leader stopped after {steps} steps; exiting", flush=True)
    return 0


def _guard_leader(engine, step_timeout: float, log) -> None:
    """Leader of a multi-controller job: a lost follower (a failed step, or one that does not return within
    ``step_timeout`` s) fails every in-flight request with that error, then ends this process with status 1."""
    import threading
    from dsflash.serve.engine.multihost import Watchdog

    once = threading.Lock()

    def lost(err):
        if not once.acquire(blocking=False):
            return
        log.error("multi-controller job lost a process: %s; failing in-flight requests and exiting", err)
        engine.fail_now(err)
        time.sleep(1.0)               # let the event loop write the error events
        print(f"error: {err}", file=sys.stderr, flush=True)
        _exit_now(1)

    link = engine.engine.runner.link
    if link is None:
        return
    link.watchdog = Watchdog(step_timeout, lost)

    def watch_engine():              # a step that raised: the engine thread has failed the requests already
        while engine.error is None:
            time.sleep(0.1)
        lost(engine.error)
    threading.Thread(target=watch_engine, name="dsflash-multihost-guard", daemon=True).start()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("dsflash.serve")
    if args.max_model_len < 2:
        print("error: --max-model-len must be >= 2", file=sys.stderr)
        return 2

    # a jax.distributed job first (before any other JAX call); followers run no HTTP
    from dsflash.serve import multihost_cli
    try:
        multi = multihost_cli.join(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if multi:
        import jax
        if jax.process_count() > 1 and getattr(args, "role", "both") != "both":
            print("error: --role prefill/decode: not with multi-controller serving (--coordinator ...)",
                  file=sys.stderr)
            return 2
        if jax.process_count() > 1 and args.model == "dummy":
            print("error: --model dummy: multi-controller serving needs a real model", file=sys.stderr)
            return 2
        if jax.process_index() > 0:
            return _follow(args)

    pd_trust = None
    if getattr(args, "role", "both") != "both":     # the P/D secret (and decode's --pd-peers) before anything else
        from dsflash.serve.pd.cli import trust_from_args
        try:
            pd_trust = trust_from_args(args)
            from dsflash.serve.pd.cli import transport_from_args
            kv_transport, why = transport_from_args(args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    # Bind first: a busy port fails in a second, not after the model has compiled.
    bound = _listen(args.host, args.port)
    if bound is None:
        if multi:
            _exit_now(1)
        return 1
    sock, url = bound

    import uvicorn

    from dsflash.serve.async_engine import AsyncEngine
    from dsflash.serve.http.app import build_app

    print(f"dsflash.serve: loading model {args.model!r} (max_model_len={args.max_model_len}, "
          f"speculative={args.speculative} ({args.speculative_mode}), precision={args.precision}, backend={args.backend}, "
          f"mesh={args.mesh or 'single device'}) ...", flush=True)
    t0 = time.time()
    role = getattr(args, "role", "both")
    if role != "both" and args.model == "dummy":
        print("error: --role prefill/decode needs a real model (not 'dummy')", file=sys.stderr)
        return 2
    if role != "both":
        from dsflash.serve.pd.engine import PDAsyncEngine as AsyncEngine  # noqa: F811
    engine = AsyncEngine(make_engine_factory(args))
    try:
        engine.start()
    except Exception as e:  # noqa: BLE001
        print(f"error: the engine failed to start: {type(e).__name__}: {e}", file=sys.stderr)
        if multi:
            _exit_now(1)
        return 1
    if multi:
        _guard_leader(engine, args.step_timeout, log)
    served = args.served_model_name or engine.model_name or args.model
    kernels = getattr(engine.engine, "kernels_line", None)
    if kernels:                    # which kernels the compiled programs use (the request for --backend)
        print(f"dsflash.serve: {kernels}", flush=True)
    app = build_app(engine, served, api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
                    tokenizer_threads=args.tokenizer_threads,
                    special_tokens_in_content=args.special_tokens_in_content)
    if role != "both":
        from dsflash.serve.pd.server import install as install_pd
        install_pd(app, engine, role, default_policy=args.kv_load_failure_policy,
                   pull_timeout=args.kv_pull_timeout, test_hooks=args.pd_test_hooks, trust=pd_trust,
                   transport=kv_transport, transfer_host=args.kv_transfer_host or args.host)
        print(f"dsflash.serve: P/D KV transport {kv_transport} ({why})", flush=True)

    import threading
    drain = {"timer": None, "aborted": 0}

    def drain_deadline():
        # streams still open get finish_reason "abort", an error event and [DONE] before uvicorn closes them
        from dsflash.serve.async_engine import RequestAbortedError
        n = engine.fail_in_flight(RequestAbortedError(
            f"server shut down: the drain timeout ({args.drain_timeout:g}s) passed before the request finished"))
        drain["aborted"] = n
        if n:
            log.warning("drain timeout: aborted %d request(s) still in flight", n)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not engine.is_draining:
                log.info("signal %s: draining (no new requests; up to %.0fs for %d in flight)",
                         sig, args.drain_timeout, engine.num_in_flight)
            if drain["timer"] is None:
                drain["timer"] = threading.Timer(args.drain_timeout, drain_deadline)
                drain["timer"].daemon = True
                drain["timer"].start()
            engine.begin_drain()
            super().handle_exit(sig, frame)
            # a drained shutdown is a clean exit (status 0): do not let uvicorn re-raise the signal
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    # uvicorn's own deadline comes after ours, so aborted streams can still send their last events
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.drain_timeout + 3,
                            timeout_keep_alive=5, access_log=args.log_level == "debug")
    server = _Server(config)
    # uvicorn puts back the handler it found once its loop ends; make that one ignore a repeated SIGTERM, so that a
    # second signal while the engine shuts down does not turn a drained, clean exit into death by signal (-15)
    if threading.current_thread() is threading.main_thread():      # (signals are only set from the main thread)
        signal.signal(signal.SIGTERM, lambda sig, frame: log.info("signal %s: already stopping", sig))
    print(f"dsflash.serve: model {served!r} ready in {time.time() - t0:.1f}s; listening on {url} "
          f"(OpenAI base URL {url}/v1){'; API key required' if args.api_key else ''}"
          f"{'; P/D role ' + role if role != 'both' else ''}", flush=True)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        if threading.current_thread() is threading.main_thread():
            # from here on ignored outright: Python's own finalisation puts back the default (fatal) action of any
            # signal that has a Python handler, but leaves an ignored one ignored
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if drain["timer"] is not None:
            drain["timer"].cancel()
        engine.shutdown()
        sock.close()
    if drain["aborted"]:       # not a clean drain: say so in the exit status
        print(f"dsflash.serve: stopped; {drain['aborted']} request(s) aborted at the drain timeout", flush=True)
        return 3
    print("dsflash.serve: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
