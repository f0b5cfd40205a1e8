"""HTTP side of the prefill and decode roles: an ASGI middleware around the ordinary OpenAI app, the KV
endpoints, and the decode side's pull.

Prefill role (``--role prefill``):
  * ``POST /v1/completions`` / ``/v1/chat/completions`` with ``kv_transfer_params: {"do_remote_decode": true}``
    (non-streaming, ``n = 1``; the router sends ``max_tokens = 1``) runs as usual; the KV is held after the
    request finishes and the JSON response gains ``kv_transfer_params`` (SERVING §4.2 names):
    ``do_remote_prefill, remote_engine_id, remote_request_id, remote_host, remote_port, remote_url,
    remote_block_ids, remote_num_tokens, first_token, tp_size, page_size``.
  * ``GET /pd/info``: the one-time handshake (engine id, layout signature).
  * ``GET /pd/kv/{rid}?skip_tokens=k``: the held KV (global entries from token ``k`` on + in-window rows) as
    one host-staged body (``dsflash.serve.pd.transfer``).
  * ``POST /pd/offer/{rid}?skip_tokens=k`` (``--kv-transport transfer``): the same KV kept on the device and
    offered to ``jax.experimental.transfer`` under a fresh uuid; the answer is its header
    (``dsflash.serve.pd.device_transfer``).
  * ``POST /pd/release/{rid}``: the decode side got it; free now (otherwise the TTL frees it).
Decode role (``--role decode``):
  * the same OpenAI endpoints; a body with ``kv_transfer_params.do_remote_prefill`` makes the server pull the
    KV from ``remote_url`` (an HTTP body, or with ``--kv-transport transfer`` device to device) before the request enters the engine, then notify the prefill side. A failed pull
    is handled by the request's ``kv_load_failure_policy`` (``fail``: HTTP 502 ``kv_transfer_failed``
    naming the prefill engine and the cause; ``recompute``: prefill locally). Response headers
    ``x-dsflash-kv-*`` say what happened and how many bytes moved.
Both roles serve ordinary requests (no ``kv_transfer_params``) exactly as the aggregated server does.

Trust (``dsflash.serve.pd.trust``, docs/pd.md "Deployment and trust"): hold requests and the KV routes need
``x-dsflash-pd-auth`` from a holder of the shared secret; a decode request's ``kv_transfer_params`` must be
signed by the router, unexpired, unused and name a ``--pd-peers`` peer (else 403 naming the field, before any
connection); the pulled body must carry the prefill side's MAC over this prompt's digest and match this
instance's layout before the engine sees it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Optional

from fastapi import Request  # module level: FastAPI resolves the (string) annotations of the endpoints here

from dsflash.serve.http.body import parse_json_object
from dsflash.serve.http.errors import APIError
from dsflash.serve.pd.cli import POLICIES, add_cli_arguments  # noqa: F401  (re-exported)
from dsflash.serve.pd.transfer import TransferSize, pack, prompt_digest, unpack
from dsflash.serve.pd.trust import AUTH_HEADER, MAC_HEADER, PDTrust, TrustError

log = logging.getLogger("dsflash.serve.pd")

GEN_PATHS = ("/v1/completions", "/v1/chat/completions")


# The middleware's verified per-request P/D state reaches the engine wrapper on the request envelope
# (EngineRequest.kv_transfer_params): the body it replays to the app carries a fresh random ticket under this key,
# and PDState.tickets maps it to the PDRequest while the request runs. A client's own value is overwritten.
TICKET = "pd_ticket"


@dataclass
class PDRequest:
    params: dict
    policy: str
    rids: list = field(default_factory=list)
    outcome: Optional[str] = None          # decode: transferred | recomputed ; prefill: held
    size: Optional[TransferSize] = None
    error: Optional[str] = None
    pull_s: float = 0.0
    verified: Optional[dict] = None        # decode: the signed fields of kv_transfer_params, once checked

    @property
    def wants_hold(self) -> bool:
        return bool(self.params.get("do_remote_decode"))

    @property
    def remote(self) -> bool:
        return bool(self.params.get("do_remote_prefill"))


class PDState:
    """Per-process P/D state shared by the middleware, the routes and the engine wrapper."""

    def __init__(self, engine, role: str, *, default_policy: str = "fail", pull_timeout: float = 60.0,
                 test_hooks: bool = False, trust: Optional[PDTrust] = None, transport: str = "http",
                 transfer_host: str = "127.0.0.1"):
        if not isinstance(trust, PDTrust):
            raise ValueError("P/D roles need the shared P/D secret (PDTrust; docs/pd.md 'Deployment and trust')")
        if role == "decode" and not trust.peers:
            raise ValueError("the decode role needs its prefill peers (--pd-peers)")
        self.trust = trust
        self.engine = engine              # PDAsyncEngine
        self.role = role
        self.default_policy = default_policy
        self.pull_timeout = pull_timeout
        self.test_hooks = test_hooks
        self.kv_delay_s = 0.0             # test hook: stall in the middle of a KV body
        self.kv_corrupt = 0               # test hook: flip a byte in the next N KV bodies (after their MAC)
        self.tickets: dict[str, "PDRequest"] = {}   # TICKET -> the request's verified P/D state, while it runs
        self.handshakes: dict[str, dict] = {}
        self.transfers: list[dict] = []   # decode side: one record per pull (bounded)
        self.counters = {"pulls_ok": 0, "pulls_failed": 0, "recomputed": 0, "failed_requests": 0,
                         "bytes_received": 0, "bytes_sent": 0, "notify_failed": 0}
        self._client = None
        self.transport = transport        # how this instance moves KV bytes: transfer | http
        self.offer_bad_uuid = 0           # test hook: answer the next N offers with a uuid nobody offers
        self.xfer = None                  # DeviceTransfer (transfer server + connections), transport "transfer"
        self._pull_pool = None
        if transport == "transfer":
            from dsflash.serve.pd.device_transfer import DeviceTransfer
            self.xfer = DeviceTransfer(transfer_host)
            if role == "prefill":
                self.xfer.port()          # start it now: a bind failure shows at start-up, not on a request

    @property
    def eng(self):
        return self.engine.engine

    def client(self):
        import httpx
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.pull_timeout, connect=5.0))
        return self._client

    # ------------------------------------------------------------------ decode: pull
    async def handshake(self, url: str) -> dict:
        if url in self.handshakes:
            return self.handshakes[url]
        r = await self.client().get(url + "/pd/info")
        r.raise_for_status()
        info = r.json()
        mine = self.eng.pd_layout.signature()
        if info.get("layout") != mine:
            raise RuntimeError(f"prefill engine {info.get('engine_id')} at {url} has an incompatible KV layout")
        self.handshakes[url] = info
        return info

    def request_of(self, kvp) -> Optional["PDRequest"]:
        """The verified P/D state of an envelope's ``kv_transfer_params`` (None: not a P/D request)."""
        t = kvp.get(TICKET) if isinstance(kvp, dict) else None
        return self.tickets.get(t) if isinstance(t, str) else None

    async def pull(self, req: "PDRequest", prompt_ids, params):
        """Pull the KV of this request's verified ``kv_transfer_params`` (the middleware checked signature,
        expiry and peer; ``kv`` itself is not trusted and not used). Before connecting: the signed prompt
        digest and token count must be this prompt's. After: the body's MAC (with this prompt's digest), then
        its header fields and every array against this instance's layout. Raises on any mismatch (the
        request's failure policy applies); nothing reaches the engine unless all of it holds."""
        v = req.verified if req is not None else None
        if not v:
            raise TrustError("kv_transfer_params were not verified; refusing to connect anywhere", "kv_transfer_params")
        url, rid, n = v["remote_url"], v["remote_request_id"], len(prompt_ids)
        digest = prompt_digest(prompt_ids)
        if v["remote_prompt_digest"] != digest or v["remote_num_tokens"] != n:
            raise TrustError(f"kv_transfer_params.remote_prompt_digest: the signed transfer is for another prompt "
                             f"({v['remote_num_tokens']} tokens) than this request's ({n} tokens); not connecting",
                             "kv_transfer_params.remote_prompt_digest")
        await self.handshake(url)
        skip = self.eng.peek_prefix_pages(prompt_ids, params) * self.eng.page_size
        if self.transport == "transfer":
            return await self._pull_transfer(url, rid, v, n, digest, skip)
        t0 = time.perf_counter()
        data = await self._fetch_verified("GET", url, f"/pd/kv/{rid}?skip_tokens={skip}", rid, v, n, digest)
        meta, arrays = unpack(data)
        _check_meta(meta, v, rid, n, digest, skip)
        self.eng.pd_layout.check_payload(arrays, n)
        dt = time.perf_counter() - t0
        return url, rid, meta, arrays, len(data), dt

    async def _fetch_verified(self, method, url, path, rid, v, n, digest):
        """One authenticated request to the prefill peer; its body must carry the MAC of this transfer."""
        r = await self.client().request(method, url + path, headers=self.trust.peer_headers(method, path))
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path.split('?')[0]} returned HTTP {r.status_code}: {r.text[:200]}")
        self.trust.verify_body(r.headers.get(MAC_HEADER), request_id=rid, engine_id=v["remote_engine_id"],
                               num_tokens=n, prompt_digest=digest, body=r.content)
        return r.content

    async def _pull_transfer(self, url, rid, v, n, digest, skip):
        """The transfer-server data plane: ask the peer to offer (authenticated), check the MAC'd offer and
        every array spec against this layout, pull device to device from the peer's host, check the
        fingerprint. Same checks, same exceptions (hence the same failure policy) as the HTTP body."""
        from concurrent.futures import ThreadPoolExecutor
        from urllib.parse import urlsplit

        from dsflash.serve.pd.device_transfer import fingerprint
        t0 = time.perf_counter()
        data = await self._fetch_verified("POST", url, f"/pd/offer/{rid}?skip_tokens={skip}", rid, v, n, digest)
        head = json.loads(data)
        uuid, port, fp, specs_in = (head.pop(k, None) for k in ("uuid", "transfer_port", "fingerprint", "arrays"))
        if type(uuid) is not int or not 0 <= uuid < 1 << 63 or type(port) is not int or not 0 < port < 65536:
            raise ValueError(f"KV offer: uuid {uuid!r} / transfer_port {port!r} malformed")
        if not isinstance(specs_in, list) or not isinstance(fp, dict) or not all(
                isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("dtype"), str)
                and isinstance(s.get("shape"), list) and all(type(d) is int and d >= 0 for d in s["shape"])
                for s in specs_in):
            raise ValueError("KV offer: malformed array specs")
        _check_meta(head, v, rid, n, digest, skip)
        try:
            specs = self.xfer.specs(specs_in)
        except TypeError as e:
            raise ValueError(f"KV offer: unknown dtype ({e})") from None
        infos = [{k: x for k, x in s.items() if k not in ("name", "dtype", "shape")} for s in specs_in]
        names = [s["name"] for s in specs_in]
        lay = self.eng.pd_layout                                             # before a byte is pulled:
        lay.check_payload(lay.unpadded_specs(list(zip(names, specs, infos))), n)
        host = urlsplit(url).hostname       # the signed, allow-listed peer: never an address from the offer
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

        def work():
            got = self.xfer.pull(address, uuid, specs)
            arrays = list(zip(names, got, infos))
            return arrays, fingerprint(arrays)

        if self._pull_pool is None:
            self._pull_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pd-pull")
        try:
            arrays, got_fp = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._pull_pool, work), self.pull_timeout)
        except asyncio.TimeoutError:
            self.xfer.forget(address)        # that pull may stay blocked: later pulls use a new connection
            raise TimeoutError(f"transfer-server pull of offer {uuid} from {address} did not finish in "
                               f"{self.pull_timeout:g}s (--kv-pull-timeout; unknown uuid or stalled peer)") from None
        if got_fp != fp:
            bad = sorted(k for k in fp if fp.get(k) != got_fp.get(k))[:4]
            raise ValueError(f"pulled KV does not match the offer's fingerprint (arrays {bad}): not the KV the "
                             f"prefill peer offered for this request")
        nbytes = len(data) + sum(int(a.nbytes) for _, a, _ in arrays)
        return url, rid, head, arrays, nbytes, time.perf_counter() - t0

    async def notify(self, url: str, rid: str):
        try:
            path = f"/pd/release/{rid}"
            await self.client().post(url + path, headers=self.trust.peer_headers("POST", path))
        except Exception as e:  # noqa: BLE001 - the TTL frees it anyway
            self.counters["notify_failed"] += 1
            log.warning("P/D: release notification for %s to %s failed: %s", rid, url, e)

    def record(self, rec: dict):
        self.transfers.append(rec)
        del self.transfers[:-1000]


def _check_meta(meta, v, rid, n, digest, skip):
    """A KV payload's (or offer's) header against the signed transfer; raises ``ValueError``."""
    want = {"request_id": rid, "engine_id": v["remote_engine_id"], "num_tokens": n, "prompt_digest": digest,
            "first_token": v["first_token"]}
    for k, x in want.items():
        if meta.get(k) != x:
            raise ValueError(f"KV payload field {k} is {meta.get(k)!r}, the signed transfer says {x!r}")
    if not isinstance(meta.get("skip_tokens"), int) or not 0 <= meta["skip_tokens"] <= skip:
        raise ValueError(f"KV payload skips {meta.get('skip_tokens')!r} tokens, asked for at most {skip}")


def install(app, engine, role: str, *, default_policy: str = "fail", pull_timeout: float = 60.0,
            test_hooks: bool = False, trust: Optional[PDTrust] = None, transport: str = "http",
            transfer_host: str = "127.0.0.1") -> PDState:
    """Add the P/D middleware and routes to ``app`` (built by ``dsflash.serve.http.app.build_app``). ``trust``
    (the shared secret, and for decode the prefill peers) is required."""
    from fastapi.responses import JSONResponse, StreamingResponse

    pd = PDState(engine, role, default_policy=default_policy, pull_timeout=pull_timeout, test_hooks=test_hooks,
                 trust=trust, transport=transport, transfer_host=transfer_host)

    def denied(request: Request, body: bytes = b""):
        """The peer check of ``/pd/kv`` and ``/pd/release``: a 403 response, or None if the caller is a peer."""
        q = request.scope.get("query_string", b"").decode("latin-1")
        try:
            pd.trust.verify_peer(request.method, request.scope["path"] + ("?" + q if q else ""),
                                 request.headers.get(AUTH_HEADER), body)
        except TrustError as e:
            return JSONResponse({"error": {"message": str(e), "type": "permission_error", "param": e.param,
                                           "code": "pd_unauthorized"}}, status_code=403)
        return None
    engine.pd = pd
    app.state.pd = pd
    # innermost, inside the OpenAI app's own middleware: the API key (401) and the body-size limit (413)
    # come before any P/D validation
    from starlette.middleware import Middleware
    app.user_middleware.append(Middleware(PDMiddleware, pd=pd))

    @app.get("/pd/info")
    async def info():
        e = pd.eng
        return {"engine_id": e.engine_id, "role": role, "model": engine.model_name, "page_size": e.page_size,
                "tp_size": 1, "layout": e.pd_layout.signature(), "sizes": e.pd_sizes, "ttl_s": e.pd_ttl,
                "kv_transports": ["transfer", "http"] if pd.xfer is not None else ["http"]}

    @app.get("/pd/stats")
    async def stats():
        e = pd.eng
        return {"engine_id": e.engine_id, "role": role, "held": len(e.held), "engine": dict(e.pd_stats),
                "counters": dict(pd.counters), "sizes": e.pd_sizes, "transfers": pd.transfers[-200:]}

    @app.get("/pd/kv/{rid}")
    async def kv(rid: str, request: Request, skip_tokens: int = 0):
        if (no := denied(request)) is not None:
            return no
        try:
            meta, arrays = await engine.run_on_engine(lambda eng: eng.extract(rid, skip_tokens))
        except KeyError:
            return JSONResponse({"error": {"message": f"no KV held for request {rid!r} (unknown, released or "
                                                      f"expired after the TTL)", "code": "kv_not_found"}},
                                status_code=404)
        body = pack(meta, arrays)
        mac = pd.trust.body_mac(request_id=rid, engine_id=meta["engine_id"], num_tokens=meta["num_tokens"],
                                prompt_digest=meta["prompt_digest"], body=body)
        if pd.kv_corrupt > 0:                 # test hook: tampering on the wire
            pd.kv_corrupt -= 1
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        pd.counters["bytes_sent"] += len(body)
        delay = pd.kv_delay_s

        async def chunks():
            step = 1 << 16
            half = len(body) // 2
            yield body[:half]
            if delay:
                await asyncio.sleep(delay)
            for i in range(half, len(body), step):
                yield body[i:i + step]

        return StreamingResponse(chunks(), media_type="application/octet-stream",
                                 headers={"content-length": str(len(body)), MAC_HEADER: mac})

    @app.post("/pd/offer/{rid}")
    async def offer(rid: str, request: Request, skip_tokens: int = 0):
        """The transfer-server path: the held KV stays on the device, offered for one pull under a fresh uuid;
        the answer is its header (MAC'd like a KV body). The pull frees it (the TTL is passed as jax's timeout;
        not checked that jax frees an offer nobody pulls)."""
        from fastapi.responses import Response

        from dsflash.serve.pd.device_transfer import fingerprint
        if (no := denied(request, await request.body())) is not None:
            return no
        if pd.xfer is None:
            return JSONResponse({"error": {"message": "this prefill instance does not offer KV through the transfer "
                                                      "server (--kv-transport http)", "code": "kv_transport_http"}},
                                status_code=404)

        def work(eng):                        # on the engine thread: it owns the state
            meta, arrays = eng.extract(rid, skip_tokens, on_device=True)
            return meta, arrays, fingerprint(arrays), pd.xfer.offer(arrays, eng.pd_ttl)
        try:
            meta, arrays, fp, uuid = await engine.run_on_engine(work)
        except KeyError:
            return JSONResponse({"error": {"message": f"no KV held for request {rid!r} (unknown, released or "
                                                      f"expired after the TTL)", "code": "kv_not_found"}},
                                status_code=404)
        if pd.offer_bad_uuid > 0:             # test hook: a uuid nobody offers
            pd.offer_bad_uuid -= 1
            uuid ^= 1
        specs = [{"name": name, "dtype": str(a.dtype), "shape": list(a.shape), **info} for name, a, info in arrays]
        body = json.dumps({**meta, "arrays": specs, "uuid": uuid, "transfer_port": pd.xfer.port(),
                           "fingerprint": fp}, separators=(",", ":")).encode()
        mac = pd.trust.body_mac(request_id=rid, engine_id=meta["engine_id"], num_tokens=meta["num_tokens"],
                                prompt_digest=meta["prompt_digest"], body=body)
        pd.counters["bytes_sent"] += len(body) + sum(int(a.nbytes) for _, a, _ in arrays)
        return Response(body, media_type="application/json", headers={MAC_HEADER: mac})

    @app.post("/pd/release/{rid}")
    async def release(rid: str, request: Request):
        if (no := denied(request, await request.body())) is not None:
            return no
        ok = await engine.run_on_engine(lambda eng: eng.release(rid))
        return {"released": bool(ok)}

    if test_hooks:
        @app.post("/pd/test/kv_delay")
        async def kv_delay(request: Request):
            pd.kv_delay_s = float((await request.json()).get("seconds", 0.0))
            return {"kv_delay_s": pd.kv_delay_s}

        @app.post("/pd/test/offer_bad_uuid")
        async def offer_bad_uuid(request: Request):
            pd.offer_bad_uuid = int((await request.json()).get("count", 1))
            return {"offer_bad_uuid": pd.offer_bad_uuid}

        @app.post("/pd/test/kv_corrupt")
        async def kv_corrupt(request: Request):
            pd.kv_corrupt = int((await request.json()).get("count", 1))
            return {"kv_corrupt": pd.kv_corrupt}

    return pd


class PDMiddleware:
    """Reads ``kv_transfer_params`` off generation requests (the body is replayed to the app), sets the
    request's P/D context, and on the prefill side adds the transfer metadata to the JSON response."""

    def __init__(self, app, pd: PDState):
        self.app = app
        self.pd = pd

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GEN_PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:                                 # a bad body is left to the app (its 400 names the problem)
            obj = parse_json_object(body)
        except APIError:
            obj = None
        kvp = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
        if not isinstance(kvp, dict) or not (kvp.get("do_remote_decode") or kvp.get("do_remote_prefill")):
            return await self.app(scope, replay, send)
        policy = obj.get("kv_load_failure_policy") or kvp.get("kv_load_failure_policy") or self.pd.default_policy
        if policy not in POLICIES:
            return await _error(send, 400, f"kv_load_failure_policy: must be one of {list(POLICIES)}, got {policy!r}",
                                "kv_load_failure_policy")
        req = PDRequest(kvp, policy)
        if req.wants_hold:
            if self.pd.role != "prefill":
                return await _error(send, 400, "kv_transfer_params.do_remote_decode: this instance is not a "
                                               "prefill instance (--role prefill)", "kv_transfer_params")
            if obj.get("stream") or (obj.get("n") or 1) != 1:
                return await _error(send, 400, "kv_transfer_params.do_remote_decode: needs stream=false and n=1",
                                    "kv_transfer_params")
            hdr = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == AUTH_HEADER.encode()),
                       None)
            try:                               # only the router (a holder of the secret) may make us hold KV
                self.pd.trust.verify_peer("POST", scope["path"], hdr, body)
            except TrustError as e:
                return await _error(send, 403, str(e), e.param, "pd_unauthorized")
        elif self.pd.role != "decode":
            return await _error(send, 400, "kv_transfer_params.do_remote_prefill: this instance is not a decode "
                                           "instance (--role decode)", "kv_transfer_params")
        else:
            try:                               # before anything else, and before any connection
                req.verified = self.pd.trust.verify_params(kvp)
            except TrustError as e:
                log.warning("P/D: refused kv_transfer_params from %s: %s", scope.get("client"), e)
                return await _error(send, 403, str(e), e.param, "pd_unauthorized")
        ticket = secrets.token_hex(16)
        self.pd.tickets[ticket] = req
        obj["kv_transfer_params"] = {**kvp, TICKET: ticket}
        body = json.dumps(obj, separators=(",", ":")).encode()     # what replay() hands the app
        try:
            if req.wants_hold:
                await self._prefill(scope, replay, send, req)
            else:
                await self._decode(scope, replay, send, req)
        finally:
            self.pd.tickets.pop(ticket, None)

    async def _decode(self, scope, receive, send, req: PDRequest):
        async def send_h(msg):
            if msg["type"] == "http.response.start":
                h = list(msg.get("headers", []))
                h.append((b"x-dsflash-kv-outcome", (req.outcome or "none").encode()))
                h.append((b"x-dsflash-kv-transport", self.pd.transport.encode()))
                if req.size is not None:
                    h.append((b"x-dsflash-kv-bytes", str(req.size.wire_bytes).encode()))
                    h.append((b"x-dsflash-kv-prompt-tokens", str(req.size.prompt_tokens).encode()))
                msg = {**msg, "headers": h}
            await send(msg)
        await self.app(scope, receive, send_h)

    async def _prefill(self, scope, receive, send, req: PDRequest):
        start, parts = None, []

        async def capture(msg):
            nonlocal start
            if msg["type"] == "http.response.start":
                start = msg
                return
            if msg["type"] == "http.response.body":
                parts.append(msg.get("body", b""))
                if msg.get("more_body", False):
                    return
                body = b"".join(parts)
                if start["status"] == 200:
                    try:
                        obj = json.loads(body)
                        obj["kv_transfer_params"] = self._params(scope, req)
                        body = json.dumps(obj, separators=(",", ":")).encode()
                    except Exception as e:  # noqa: BLE001
                        log.exception("P/D: could not attach kv_transfer_params")
                        body = json.dumps({"error": {"message": f"prefill finished but its KV could not be "
                                                                f"offered: {e}", "code": "kv_transfer_failed",
                                                     "type": "internal_server_error", "param": None}}).encode()
                        start = {**start, "status": 500}
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await send(msg)

        await self.app(scope, receive, capture)

    def _params(self, scope, req: PDRequest) -> dict:
        eng = self.pd.eng
        if len(req.rids) != 1:
            raise RuntimeError(f"expected one engine request, got {len(req.rids)}")
        rid = req.rids[0]
        h = eng.held.get(rid)
        if h is None:
            raise RuntimeError(f"no KV held for {rid} (aborted?)")
        host, port = scope.get("server") or ("127.0.0.1", 0)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": eng.engine_id,
                "remote_request_id": rid, "remote_host": host, "remote_port": port,
                "remote_url": f"http://{host}:{port}", "remote_block_ids": list(h.pages),
                "remote_num_tokens": h.num_tokens, "remote_prompt_digest": prompt_digest(h.prompt_ids),
                "first_token": h.first_token, "tp_size": 1,
                "page_size": eng.page_size, "kv_load_failure_policy": req.policy}


async def _error(send, status, message, param=None, code=None):
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "internal_server_error", "param": param, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})

