"""The P/D trust boundary (docs/pd.md "Deployment and trust"); standard library only (the router imports it).

One shared secret (``--pd-secret-file FILE``, ``--pd-secret S`` or ``$DSFLASH_PD_SECRET``; at least
``MIN_SECRET_BYTES`` bytes) is known to the router and to every prefill and decode instance. It gives three
HMAC-SHA256 tags, each over a canonical JSON encoding (sorted keys, no spaces) prefixed by its purpose, so a
tag of one kind never verifies as another:

* ``params``: the router signs the ``kv_transfer_params`` it forwards to a decode instance: the prefill
  peer's URL (the one the router itself reached, not what anybody reported), engine id, request id, token
  count, the prompt token ids' digest, the first token and an expiry. The decode instance verifies the tag,
  the expiry, one-time use and that the URL is in its ``--pd-peers`` allow-list *before* it connects
  anywhere; a bad one is answered 403 naming the field.
* ``peer``: requests between instances (the router's hold request to a prefill instance, the decode
  instance's ``GET /pd/kv`` and ``POST /pd/release``) carry ``x-dsflash-pd-auth: <expires>.<tag>`` over the
  method, path + query, expiry and the body's SHA-256. The prefill instance refuses these routes without it.
* ``kv-body``: the prefill instance sends, with each KV body, ``x-dsflash-kv-mac`` over the request id,
  engine id, token count, prompt digest and the body's SHA-256. The decode instance recomputes it with the
  values it expects (its own digest of the prompt's token ids) before it parses the body.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from urllib.parse import urlsplit

MIN_SECRET_BYTES = 16
PARAMS_TTL_S = 120.0          # router-signed kv_transfer_params are valid this long (clocks must agree: NTP)
PEER_TTL_S = 120.0
AUTH_HEADER = "x-dsflash-pd-auth"
MAC_HEADER = "x-dsflash-kv-mac"
SECRET_ENV = "DSFLASH_PD_SECRET"
# the signed fields of kv_transfer_params, with their types (a field of another type does not verify)
SIGNED = {"remote_url": str, "remote_engine_id": str, "remote_request_id": str, "remote_num_tokens": int,
          "remote_prompt_digest": str, "first_token": int, "pd_expires": int}


class TrustError(Exception):
    """A P/D authentication failure; ``param`` names the offending field or header."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def load_secret(secret: str | None = None, secret_file: str | None = None, env=None) -> bytes | None:
    """The shared secret from ``secret_file``, else ``secret``, else ``$DSFLASH_PD_SECRET``; ``None`` if none
    is given. Raises ``ValueError`` for an unreadable file or a secret shorter than ``MIN_SECRET_BYTES``."""
    env = os.environ if env is None else env
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                raw = f.read().strip()
        except OSError as e:
            raise ValueError(f"--pd-secret-file {secret_file}: {e}") from None
        where = f"--pd-secret-file {secret_file}"
    elif secret:
        raw, where = secret.strip().encode(), "--pd-secret"
    elif env.get(SECRET_ENV):
        raw, where = env[SECRET_ENV].strip().encode(), f"${SECRET_ENV}"
    else:
        return None
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"{where}: the P/D secret must be at least {MIN_SECRET_BYTES} bytes "
                         f"(e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > pd.key`)")
    return raw


def peer_key(url_or_hostport: str) -> str:
    """``host:port`` (host lower-cased, IPv6 in brackets) of a URL or ``host:port``; the allow-list unit."""
    s = url_or_hostport.strip()
    if "://" not in s:
        s = "http://" + s
    u = urlsplit(s)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not a peer address: {url_or_hostport!r}")
    if u.username or u.password or (u.path not in ("", "/")) or u.query or u.fragment:
        raise ValueError(f"a peer is host:port or a base URL without path, query or credentials: "
                         f"{url_or_hostport!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    host = u.hostname.lower()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_peers(spec) -> frozenset:
    """``"h:p,h2:p2"`` (or a list of such strings / URLs) -> the allow-list."""
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    out = set()
    for item in items:
        for part in str(item or "").split(","):
            if part.strip():
                out.add(peer_key(part))
    return frozenset(out)


def _canon(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class PDTrust:
    def __init__(self, secret: bytes, peers=()):
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the P/D secret must be at least {MIN_SECRET_BYTES} bytes")
        self._key = secret
        self.peers = parse_peers(list(peers)) if peers else frozenset()
        self._used: dict[str, float] = {}          # one-time use of signed params: tag -> expiry

    def tag(self, purpose: str, obj) -> str:
        return hmac.new(self._key, purpose.encode() + b"\0" + _canon(obj), hashlib.sha256).hexdigest()

    def _check(self, purpose: str, obj, tag, param: str,
               why: str = "P/D requests must come through the router, which holds the shared P/D secret"):
        if not isinstance(tag, str) or not hmac.compare_digest(self.tag(purpose, obj), tag):
            raise TrustError(f"{param}: invalid or missing signature ({why})", param)

    # ------------------------------------------------------------------ kv_transfer_params (router -> decode)
    def sign_params(self, kvp: dict, prefill_url: str, *, prompt_digest: str | None = None,
                    ttl: float = PARAMS_TTL_S, now: float | None = None) -> dict:
        """The router's copy of a prefill instance's ``kv_transfer_params``, pointed at ``prefill_url`` (the
        address the router reached it at) and signed."""
        u = urlsplit(prefill_url.rstrip("/"))
        out = dict(kvp)
        out.update({"remote_url": prefill_url.rstrip("/"), "remote_host": u.hostname, "remote_port": u.port,
                    "pd_expires": int((time.time() if now is None else now) + ttl)})
        if prompt_digest is not None:
            out["remote_prompt_digest"] = prompt_digest
        signed = {}
        for k, typ in SIGNED.items():
            v = out.get(k)
            if type(v) is not typ:
                raise ValueError(f"kv_transfer_params.{k}: expected {typ.__name__}, got {v!r}")
            signed[k] = v
        out["pd_sig"] = self.tag("params", signed)
        return out

    def verify_params(self, kvp: dict, *, now: float | None = None, consume: bool = True) -> dict:
        """Check a decode request's ``kv_transfer_params`` before any connection: every signed field present
        with its type, the tag, the expiry, the peer in the allow-list, not used before. Returns the signed
        fields; raises ``TrustError`` naming the field."""
        now = time.time() if now is None else now
        signed = {}
        for k, typ in SIGNED.items():
            v = kvp.get(k)
            if type(v) is not typ:
                raise TrustError(f"kv_transfer_params.{k}: missing or not a {typ.__name__} (P/D requests must come "
                                 f"through the router)", f"kv_transfer_params.{k}")
            signed[k] = v
        self._check("params", signed, kvp.get("pd_sig"), "kv_transfer_params.pd_sig")
        if signed["pd_expires"] < now:
            raise TrustError(f"kv_transfer_params.pd_expires: the signed transfer parameters expired "
                             f"{now - signed['pd_expires']:.0f}s ago", "kv_transfer_params.pd_expires")
        try:
            peer = peer_key(signed["remote_url"])
        except ValueError as e:
            raise TrustError(f"kv_transfer_params.remote_url: {e}", "kv_transfer_params.remote_url") from None
        if peer not in self.peers:
            raise TrustError(f"kv_transfer_params.remote_url: {peer} is not a prefill peer of this instance "
                             f"(--pd-peers)", "kv_transfer_params.remote_url")
        if consume:
            for t in [t for t, e in self._used.items() if e < now]:
                del self._used[t]
            if kvp["pd_sig"] in self._used:
                raise TrustError("kv_transfer_params.pd_sig: these signed transfer parameters were already used",
                                 "kv_transfer_params.pd_sig")
            self._used[kvp["pd_sig"]] = float(signed["pd_expires"])
        return signed

    # ------------------------------------------------------------------ requests between instances
    def peer_headers(self, method: str, path: str, body: bytes = b"", *, now: float | None = None) -> dict:
        exp = int((time.time() if now is None else now) + PEER_TTL_S)
        t = self.tag("peer", {"method": method.upper(), "path": path, "expires": exp, "body": sha256_hex(body)})
        return {AUTH_HEADER: f"{exp}.{t}"}

    def verify_peer(self, method: str, path: str, header, body: bytes = b"", *, now: float | None = None):
        """``path`` includes the query string exactly as sent. Raises ``TrustError``."""
        now = time.time() if now is None else now
        try:
            exp_s, t = (header or "").split(".", 1)
            exp = int(exp_s)
        except ValueError:
            raise TrustError(f"{AUTH_HEADER}: missing or malformed (only P/D peers holding the shared secret may "
                             f"call this)", AUTH_HEADER) from None
        self._check("peer", {"method": method.upper(), "path": path, "expires": exp, "body": sha256_hex(body)},
                    t, AUTH_HEADER, "only P/D peers holding the shared secret may call this")
        if exp < now or exp > now + 2 * PEER_TTL_S:
            raise TrustError(f"{AUTH_HEADER}: expired or not yet valid (clocks must agree)", AUTH_HEADER)

    # ------------------------------------------------------------------ KV bodies (prefill -> decode)
    def body_mac(self, *, request_id: str, engine_id: str, num_tokens: int, prompt_digest: str,
                 body: bytes) -> str:
        return self.tag("kv-body", {"request_id": request_id, "engine_id": engine_id, "num_tokens": int(num_tokens),
                                    "prompt_digest": prompt_digest, "body": sha256_hex(body)})

    def verify_body(self, mac, **kw):
        self._check("kv-body", {"request_id": kw["request_id"], "engine_id": kw["engine_id"],
                                "num_tokens": int(kw["num_tokens"]), "prompt_digest": kw["prompt_digest"],
                                "body": sha256_hex(kw["body"])}, mac, MAC_HEADER,
                    "the KV body is not the one the prefill peer sent for this request and prompt")
