"""``python -m dsflash.serve.router --prefill URL... --decode URL...``: the P/D router (docs/pd.md).

An OpenAI-compatible front (``/v1/completions``, ``/v1/chat/completions``, streaming or not, ``/v1/models``,
``/health``, ``/metrics``, ``/router/stats``) over prefill instances (``--role prefill``) and decode instances
(``--role decode``) of ``python -m dsflash.serve``. Per request (vLLM / llm-d style, P then D):

1. pick a decode instance: the one holding the longest known prefix of this conversation (affinity by a
   chain of hashes over the prompt text, or the chat messages, in ``--affinity-block`` character blocks;
   the prefix must cover ``--affinity-threshold`` of the prompt's blocks), unless it is more than
   ``--affinity-slack`` requests busier than the least loaded one; else the least loaded (router-side
   in-flight count, round-robin on ties);
2. send the request to the least loaded prefill instance with ``max_tokens = 1``, ``stream = false`` and
   ``kv_transfer_params = {"do_remote_decode": true}``; it answers with the transfer metadata;
3. send the original request plus that metadata (and ``kv_load_failure_policy``) to the decode instance and
   stream its answer back.

Requests with ``n > 1`` (or with no prefill instance configured) go to a decode instance directly (it
prefills them itself). Nothing is retried: a failed prefill or decode instance gives the client an OpenAI
error body naming the instance and the cause (HTTP 502) and is counted in ``/router/stats`` and
``/metrics``; the decode instance applies the request's failure policy to a failed KV pull.

Trust (docs/pd.md "Deployment and trust"): the router is the only port that faces clients. It holds the
shared P/D secret (``--pd-secret-file``), drops any ``kv_transfer_params`` a client sends, authenticates its
hold requests to prefill instances, and signs the ``kv_transfer_params`` it forwards to a decode instance
(pointed at the prefill URL it was configured with, bound to the prompt's token-id digest, expiring).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import logging
import os
import sys
import time
from collections import OrderedDict, deque
from typing import Optional

from fastapi import Request  # module level: FastAPI resolves the (string) annotations of the endpoints here

from dsflash.serve.pd.trust import PDTrust, load_secret

log = logging.getLogger("dsflash.serve.router")

GEN_PATHS = ("/v1/completions", "/v1/chat/completions")
PASS_HEADERS = ("x-dsflash-kv-outcome", "x-dsflash-kv-bytes", "x-dsflash-kv-prompt-tokens")


def _err(status: int, message: str, code: str, type_: str = "server_error", param=None):
    from fastapi.responses import JSONResponse
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


class Instance:
    def __init__(self, url: str, kind: str):
        self.url = url.rstrip("/")
        self.kind = kind
        self.in_flight = 0
        self.requests = 0
        self.failures = 0

    def stats(self) -> dict:
        return {"url": self.url, "in_flight": self.in_flight, "requests": self.requests, "failures": self.failures}


def prefix_hashes(text: str, block: int) -> list[str]:
    """Chain hashes of the full ``block``-character prefixes of ``text``."""
    out, h = [], b""
    for i in range(block, len(text) + 1, block):
        h = hashlib.blake2b(h + text[i - block:i].encode("utf-8", "surrogatepass"), digest_size=8).digest()
        out.append(h.hex())
    return out


def conversation_text(path: str, body: dict) -> str:
    if path.endswith("/chat/completions"):
        msgs = body.get("messages") or []
        return "".join(json.dumps(m, sort_keys=True, ensure_ascii=False) + "\n" for m in msgs)
    p = body.get("prompt")
    return p if isinstance(p, str) else json.dumps(p)


class Router:
    def __init__(self, prefill: list[str], decode: list[str], *, policy: str = "fail", affinity_block: int = 256,
                 affinity_slack: int = 4, affinity_threshold: float = 0.5, affinity_capacity: int = 200_000,
                 timeout: float = 600.0, trust: Optional[PDTrust] = None, api_key: Optional[str] = None,
                 backend_api_key: Optional[str] = None):
        if not decode:
            raise ValueError("at least one --decode instance is needed")
        if prefill and trust is None:
            raise ValueError("a router with --prefill instances needs the shared P/D secret (--pd-secret-file FILE, "
                             "--pd-secret or $DSFLASH_PD_SECRET; the same one the prefill and decode instances get)")
        self.trust = trust
        self.api_key = api_key                  # what clients must send the router (None: no check)
        self.backend_api_key = backend_api_key  # what the router sends the instances (None: the client's header)
        self.prefill = [Instance(u, "prefill") for u in prefill]
        self.decode = [Instance(u, "decode") for u in decode]
        self.policy = policy
        self.block = affinity_block
        self.slack = affinity_slack
        self.threshold = affinity_threshold
        self.capacity = affinity_capacity
        self.affinity: "OrderedDict[str, int]" = OrderedDict()
        self.timeout = timeout
        self.counters = {"requests": 0, "pd_requests": 0, "direct_requests": 0, "affinity_hits": 0,
                         "affinity_misses": 0, "affinity_overridden": 0, "failed_requests": 0,
                         "prefill_failures": 0, "decode_failures": 0, "kv_recomputed": 0, "kv_bytes": 0}
        self.failures: deque = deque(maxlen=200)
        self._rr = itertools.count()
        self._client = None

    def client(self):
        import httpx
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=5.0),
                                             limits=httpx.Limits(max_connections=1024,
                                                                 max_keepalive_connections=256))
        return self._client

    # ------------------------------------------------------------------ choice
    def _least(self, pool: list[Instance]) -> Instance:
        lo = min(i.in_flight for i in pool)
        cands = [i for i in pool if i.in_flight == lo]
        return cands[next(self._rr) % len(cands)]

    def pick_decode(self, path: str, body: dict) -> tuple[Instance, str]:
        hashes = prefix_hashes(conversation_text(path, body), self.block)
        chosen, how = None, "miss"
        for k in range(len(hashes) - 1, -1, -1):
            idx = self.affinity.get(hashes[k])
            if idx is not None and (k + 1) < self.threshold * len(hashes):
                break           # only a short shared prefix (a common system prompt): not this conversation
            if idx is not None:
                inst = self.decode[idx]
                lo = min(i.in_flight for i in self.decode)
                if inst.in_flight <= lo + self.slack:
                    chosen, how = inst, "hit"
                else:
                    how = "overridden"
                break
        if chosen is None:
            chosen = self._least(self.decode)
        self.counters[{"hit": "affinity_hits", "miss": "affinity_misses", "overridden": "affinity_overridden"}[how]] += 1
        idx = self.decode.index(chosen)
        for h in hashes:
            self.affinity[h] = idx
            self.affinity.move_to_end(h)
        while len(self.affinity) > self.capacity:
            self.affinity.popitem(last=False)
        return chosen, how

    def fail(self, status: int, message: str, code: str, **info):
        self.counters["failed_requests"] += 1
        self.failures.append({"time": time.time(), "status": status, "code": code, "message": message, **info})
        log.error("router: %s", message)
        return _err(status, message, code)

    # ------------------------------------------------------------------ one request
    async def handle(self, path: str, raw: bytes, auth: Optional[str] = None):
        import httpx
        from fastapi.responses import Response, StreamingResponse
        self.counters["requests"] += 1
        from dsflash.serve.http.body import parse_json_object
        from dsflash.serve.http.errors import APIError
        try:                                   # the server's checks: depth limit (no RecursionError), surrogates
            body = parse_json_object(raw)
        except APIError as e:
            return _err(e.status, e.message, e.code, e.type, e.param)
        if "kv_transfer_params" in body:       # the router's to set, never a client's (docs/pd.md)
            self.counters["client_kv_params_dropped"] = self.counters.get("client_kv_params_dropped", 0) + 1
            body.pop("kv_transfer_params")
        if self.backend_api_key:                             # the router's own credential towards the instances
            fwd = {"authorization": f"Bearer {self.backend_api_key}"}
        elif self.api_key:                                   # never pass the router's key on
            fwd = {}
        else:                                                # instances started with --api-key, no router key
            fwd = {"authorization": auth} if auth else {}
        policy = body.get("kv_load_failure_policy") or self.policy
        dec, how = self.pick_decode(path, body)
        headers = {"x-dsflash-decode": dec.url, "x-dsflash-affinity": how}
        kvp = None
        pre = None
        n = body.get("n") or 1
        if self.prefill and n == 1:
            self.counters["pd_requests"] += 1
            pre = self._least(self.prefill)
            headers["x-dsflash-prefill"] = pre.url
            pbody = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            if path.endswith("/chat/completions") and body.get("max_completion_tokens") is not None:
                pbody["max_completion_tokens"] = 1
            else:
                pbody["max_tokens"] = 1
            pbody["stream"] = False
            pbody["kv_transfer_params"] = {"do_remote_decode": True}
            praw = json.dumps(pbody, separators=(",", ":")).encode()
            pheaders = {**fwd, "content-type": "application/json", **self.trust.peer_headers("POST", path, praw)}
            pre.in_flight += 1
            pre.requests += 1
            why, r = None, None
            try:
                r = await self.client().post(pre.url + path, content=praw, headers=pheaders)
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e or 'no response'}"
            finally:
                pre.in_flight -= 1
            if why is None and r.status_code >= 500:
                why = f"HTTP {r.status_code}: {r.text[:200]}"
            if why is not None and policy == "recompute":
                # the prefill instance is gone or broken: the decode instance prefills the request itself
                pre.failures += 1
                self.counters["prefill_failures"] += 1
                self.counters["kv_recomputed"] += 1
                self.failures.append({"time": time.time(), "status": 0, "code": "prefill_failed_recomputed",
                                      "message": why, "prefill": pre.url})
                log.warning("router: prefill instance %s failed (%s); policy recompute: decode prefills", pre.url, why)
                headers["x-dsflash-kv-outcome"] = "recomputed"
                return await self._to_decode(path, body, None, None, dec, headers, fwd)
            if r is None:
                pre.failures += 1
                self.counters["prefill_failures"] += 1
                return self.fail(502, f"prefill instance {pre.url} failed: {why} (not retried)", "prefill_failed",
                                 prefill=pre.url)
            if r.status_code != 200:
                if r.status_code >= 500:
                    pre.failures += 1
                    self.counters["prefill_failures"] += 1
                    self.counters["failed_requests"] += 1
                    self.failures.append({"time": time.time(), "status": r.status_code, "code": "prefill_error",
                                          "message": r.text[:500], "prefill": pre.url})
                return Response(r.content, status_code=r.status_code, media_type="application/json", headers=headers)
            kvp = r.json().get("kv_transfer_params")
            if not kvp:
                pre.failures += 1
                self.counters["prefill_failures"] += 1
                return self.fail(502, f"prefill instance {pre.url} returned no kv_transfer_params", "prefill_failed",
                                 prefill=pre.url)
            try:            # the decode side will connect to pre.url (what we reached), never a reported address
                kvp = self.trust.sign_params(kvp, pre.url)
            except ValueError as e:
                pre.failures += 1
                self.counters["prefill_failures"] += 1
                return self.fail(502, f"prefill instance {pre.url} returned unusable kv_transfer_params: {e}",
                                 "prefill_failed", prefill=pre.url)
        else:
            self.counters["direct_requests"] += 1
        return await self._to_decode(path, body, kvp, pre, dec, headers, fwd, policy)

    async def _to_decode(self, path, body, kvp, pre, dec, headers, fwd, policy=None):
        """Send the request (with the signed ``kvp``, or none: the decode instance prefills) to ``dec``."""
        import httpx
        from fastapi.responses import Response, StreamingResponse
        dbody = dict(body)
        if kvp is not None:
            dbody["kv_transfer_params"] = kvp
            dbody["kv_load_failure_policy"] = policy or self.policy
        dec.in_flight += 1
        dec.requests += 1
        released = False

        def done():
            nonlocal released
            if not released:
                released = True
                dec.in_flight -= 1

        async def give_back_kv():
            if kvp is not None and pre is not None:
                try:
                    rpath = f"/pd/release/{kvp['remote_request_id']}"
                    await self.client().post(pre.url + rpath, headers=self.trust.peer_headers("POST", rpath))
                except httpx.HTTPError:
                    pass

        try:
            req = self.client().build_request("POST", dec.url + path, json=dbody, headers=fwd)
            resp = await self.client().send(req, stream=True)
        except httpx.HTTPError as e:
            done()
            dec.failures += 1
            self.counters["decode_failures"] += 1
            await give_back_kv()
            return self.fail(502, f"decode instance {dec.url} failed: {type(e).__name__}: {e or 'no response'} "
                                  f"(not retried)", "decode_failed", decode=dec.url)
        for h in PASS_HEADERS:
            if h in resp.headers:
                headers[h] = resp.headers[h]
        if resp.headers.get("x-dsflash-kv-outcome") == "recomputed":
            self.counters["kv_recomputed"] += 1
        try:
            self.counters["kv_bytes"] += int(resp.headers.get("x-dsflash-kv-bytes", 0))
        except ValueError:
            pass
        ctype = resp.headers.get("content-type", "application/json")
        if resp.status_code != 200 or not ctype.startswith("text/event-stream"):
            try:
                content = await resp.aread()
            except httpx.HTTPError as e:
                done()
                dec.failures += 1
                self.counters["decode_failures"] += 1
                return self.fail(502, f"decode instance {dec.url} failed mid-response: {e}", "decode_failed",
                                 decode=dec.url)
            finally:
                await resp.aclose()
            done()
            if resp.status_code >= 500:
                dec.failures += 1
                self.counters["failed_requests"] += 1
                self.failures.append({"time": time.time(), "status": resp.status_code,
                                      "code": _code_of(content), "message": content[:500].decode("utf-8", "replace"),
                                      "decode": dec.url, "prefill": pre.url if pre else None})
            return Response(content, status_code=resp.status_code, media_type=ctype.split(";")[0], headers=headers)

        async def cleanup():
            done()
            await resp.aclose()

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                dec.failures += 1
                self.counters["decode_failures"] += 1
                self.counters["failed_requests"] += 1
                msg = f"decode instance {dec.url} failed mid-stream: {type(e).__name__}: {e} (not retried)"
                self.failures.append({"time": time.time(), "status": 502, "code": "decode_failed", "message": msg,
                                      "decode": dec.url})
                log.error("router: %s", msg)
                yield ("data: " + json.dumps({"error": {"message": msg, "type": "server_error", "param": None,
                                                        "code": "decode_failed"}}) + "\n\ndata: [DONE]\n\n").encode()
            finally:
                done()
                await resp.aclose()

        from starlette.background import BackgroundTask
        return StreamingResponse(relay(), media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"},
                                 background=BackgroundTask(cleanup))

    def stats(self) -> dict:
        return {"counters": dict(self.counters), "prefill": [i.stats() for i in self.prefill],
                "decode": [i.stats() for i in self.decode], "affinity_entries": len(self.affinity),
                "failures": list(self.failures)[-50:], "policy": self.policy}


def _code_of(content: bytes) -> Optional[str]:
    try:
        return json.loads(content)["error"]["code"]
    except Exception:  # noqa: BLE001
        return None


def build_app(router: Router):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    import hmac
    app = FastAPI(title="dsflash router")
    app.state.router = router

    def refused(request: Request):
        """The router's own ``--api-key`` on ``/v1/*``: a 401 before the body is even read, else None."""
        if not router.api_key:
            return None
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if token and hmac.compare_digest(token.encode(), router.api_key.encode()):
            return None
        return _err(401, "Missing API key (send 'Authorization: Bearer <key>')" if not token
                    else "Incorrect API key provided", "invalid_api_key", "authentication_error")

    @app.post("/v1/completions")
    async def completions(request: Request):
        if (no := refused(request)) is not None:
            return no
        return await router.handle("/v1/completions", await request.body(), request.headers.get("authorization"))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if (no := refused(request)) is not None:
            return no
        return await router.handle("/v1/chat/completions", await request.body(),
                                   request.headers.get("authorization"))

    @app.get("/v1/models")
    async def models(request: Request):
        import httpx
        if (no := refused(request)) is not None:
            return no
        for d in router.decode:
            try:
                hdr = {"authorization": f"Bearer {router.backend_api_key}"} if router.backend_api_key else {}
                r = await router.client().get(d.url + "/v1/models", headers=hdr)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return _err(502, "no decode instance answered /v1/models", "decode_failed")

    @app.get("/health")
    async def health():
        import httpx

        async def one(inst):
            try:
                r = await router.client().get(inst.url + "/health", timeout=2.0)
                return r.status_code == 200
            except httpx.HTTPError:
                return False
        insts = router.prefill + router.decode
        ok = await asyncio.gather(*(one(i) for i in insts))
        status = {i.url: ("ok" if o else "down") for i, o in zip(insts, ok)}
        good = any(o for i, o in zip(insts, ok) if i.kind == "decode") and (
            not router.prefill or any(o for i, o in zip(insts, ok) if i.kind == "prefill"))
        return JSONResponse({"status": "ok" if good else "degraded", "instances": status},
                            status_code=200 if good else 503)

    @app.get("/router/stats")
    async def stats():
        return router.stats()

    @app.get("/metrics")
    async def metrics():
        lines = []
        for k, v in router.counters.items():
            lines.append(f"dsflash_router_{k}_total {v}")
        for inst in router.prefill + router.decode:
            for k in ("in_flight", "requests", "failures"):
                lines.append(f'dsflash_router_instance_{k}{{role="{inst.kind}",url="{inst.url}"}} {getattr(inst, k)}')
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


def build_parser():
    p = argparse.ArgumentParser(prog="python -m dsflash.serve.router", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", nargs="*", default=[], help="base URLs of prefill instances (--role prefill)")
    p.add_argument("--decode", nargs="+", required=True, help="base URLs of decode instances (--role decode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed)")
    p.add_argument("--kv-load-failure-policy", default="fail", choices=["fail", "recompute"],
                   help="default failure policy for requests that do not send kv_load_failure_policy")
    p.add_argument("--affinity-block", type=int, default=256,
                   help="characters per prefix-hash block for conversation affinity")
    p.add_argument("--affinity-slack", type=int, default=4,
                   help="keep a conversation on its decode instance unless that one has more than this many "
                        "requests in flight above the least loaded")
    p.add_argument("--affinity-threshold", type=float, default=0.5,
                   help="a known prefix counts only if it covers at least this fraction of the prompt's blocks "
                        "(a shared system prompt alone does not pin every session to one instance)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for one upstream request")
    p.add_argument("--pd-secret-file", default=None,
                   help="file holding the shared P/D secret (>= 16 bytes) of the prefill and decode instances; "
                        "required with --prefill (or --pd-secret / $DSFLASH_PD_SECRET)")
    p.add_argument("--pd-secret", default=None, help="the secret itself (visible in the process list)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--api-key", default=os.environ.get("DSFLASH_ROUTER_API_KEY"),
                   help="require 'Authorization: Bearer <key>' from clients on /v1/* (401 otherwise); the router "
                        "then does not pass the client's header on. Default: $DSFLASH_ROUTER_API_KEY, else none")
    p.add_argument("--backend-api-key", default=os.environ.get("DSFLASH_API_KEY"),
                   help="the key the router sends to the instances (their --api-key); default: $DSFLASH_API_KEY, "
                        "else the client's Authorization header is forwarded when the router has no --api-key")
    return p


def main(argv=None) -> int:
    import uvicorn

    from dsflash.serve.__main__ import _listen
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        secret = load_secret(args.pd_secret, args.pd_secret_file)
        trust = PDTrust(secret) if secret is not None else None
        if args.prefill and trust is None:
            raise ValueError("--prefill needs the shared P/D secret (--pd-secret-file FILE, --pd-secret or "
                             "$DSFLASH_PD_SECRET; the same one the prefill and decode instances get; "
                             "docs/pd.md 'Deployment and trust')")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bound = _listen(args.host, args.port)
    if bound is None:
        return 1
    sock, url = bound
    router = Router(args.prefill, args.decode, policy=args.kv_load_failure_policy,
                    affinity_block=args.affinity_block, affinity_slack=args.affinity_slack,
                    affinity_threshold=args.affinity_threshold, timeout=args.timeout, trust=trust,
                    api_key=args.api_key, backend_api_key=args.backend_api_key)
    app = build_app(router)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level == "debug"))
    print(f"dsflash.serve.router: listening on {url} (OpenAI base URL {url}/v1); "
          f"prefill {args.prefill or 'none'}; decode {args.decode}", flush=True)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
