"""The KV data plane through ``jax.experimental.transfer`` (``--kv-transport transfer``, docs/pd.md).

The HTTP control plane stays as it is; only the bytes move differently:

* prefill: ``POST /pd/offer/{rid}`` (peer-authenticated) gathers the held KV on device (no host copy),
  registers it with ``TransferServer.await_pull`` under a fresh random 63-bit uuid and answers a JSON
  header (the same ``meta`` and per-array ``info`` as the HTTP body's header, plus shapes, the uuid, the
  transfer server's port and a device fingerprint of the arrays), MAC'd like a KV body;
* decode: verifies the MAC, the header and every array spec against its layout *before* pulling, pulls
  from the transfer server of the peer it was configured to trust (host of the signed ``remote_url``; the
  port comes from the MAC'd offer), then checks the fingerprint of what arrived.

Why a fingerprint and not a hash of the bytes: hashing would need the host copy this path avoids. It detects
a wrong, truncated or mixed-up pull, not a forger on the transfer socket (that socket is plain TCP without
authentication; the uuid is a one-time capability handed out only over the authenticated control plane).

A pull of a uuid the peer does not offer does not fail in jax 0.10.2 (``timeout=`` is not honoured either):
it blocks until the peer process exits. So the pull runs in a worker thread under ``--kv-pull-timeout``;
after a timeout that connection is dropped (a new one is made for the next pull).
"""
from __future__ import annotations

import datetime
import logging
import secrets
import threading

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("dsflash.serve.pd")

TRANSPORTS = ("transfer", "http")


def available() -> str | None:
    """``None`` if ``jax.experimental.transfer`` can be used here, else why not (for the start-up log)."""
    try:
        import jax.experimental.transfer as t
        if not hasattr(t, "start_transfer_server"):
            return "jax.experimental.transfer has no start_transfer_server"
    except Exception as e:  # noqa: BLE001 - any import failure means: use HTTP
        return f"import jax.experimental.transfer failed: {type(e).__name__}: {e}"
    return None


def choose_transport(asked: str | None) -> tuple[str, str]:
    """(transport, why) for ``--kv-transport`` (None/'auto': transfer when available, else http)."""
    why_not = available()
    if asked in (None, "auto"):
        return ("http", f"jax.experimental.transfer unavailable ({why_not})") if why_not else \
               ("transfer", "default: jax.experimental.transfer available")
    if asked == "transfer" and why_not:
        raise ValueError(f"--kv-transport transfer: {why_not} (use --kv-transport http)")
    return asked, "asked for"


def _words(a):
    """``a``'s bytes as flat uint32 words (bitcast; 1- and 2-byte dtypes grouped 4 or 2 to a word when the size
    allows, so the fingerprint reads 4 bytes per element, not 1)."""
    size = a.dtype.itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(a, jnp.uint32).reshape(-1)
    a = jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]).reshape(-1)
    k = 4 // size
    if k > 1 and a.shape[0] % k == 0:
        return jax.lax.bitcast_convert_type(a.reshape(-1, k), jnp.uint32)
    return a.astype(jnp.uint32)


@jax.jit
def _fingerprint(arrays: dict):
    """Per array: (sum of words, sum of words * (position + 1)), mod 2**32: order- and value-sensitive."""
    out = {}
    for k, a in arrays.items():
        w = _words(a)
        pos = jnp.arange(1, w.shape[0] + 1, dtype=jnp.uint32)
        out[k] = jnp.stack([w.sum(dtype=jnp.uint32), (w * pos).sum(dtype=jnp.uint32)])
    return out


def fingerprint(arrays) -> dict:
    """``{name: [u32, u32]}`` of ``[(name, array, info)]`` (computed where the arrays live)."""
    fp = jax.device_get(_fingerprint({name: a for name, a, _ in arrays}))
    return {k: [int(x) for x in np.asarray(v)] for k, v in fp.items()}


class DeviceTransfer:
    """One process's transfer server (started on first use) and its connections to peers."""

    def __init__(self, bind_host: str = "127.0.0.1", device=None):
        self.bind_host = bind_host
        self.device = device if device is not None else jax.devices()[0]
        self._server = None
        self._conns: dict[str, object] = {}
        self._lock = threading.Lock()

    @property
    def server(self):
        with self._lock:
            if self._server is None:
                import jax.experimental.transfer as t
                addr = f"[{self.bind_host}]:0" if ":" in self.bind_host else f"{self.bind_host}:0"
                self._server = t.start_transfer_server(self.device.client, addr, [addr])
                log.info("P/D: transfer server listening at %s", self._server.address())
            return self._server

    def port(self) -> int:
        return int(self.server.address().rsplit(":", 1)[1])

    # ------------------------------------------------------------------ prefill side
    def offer(self, arrays, ttl_s: float) -> int:
        """Register the device arrays of ``[(name, array, info)]`` for one pull; returns the uuid."""
        uuid = secrets.randbits(63)
        until = datetime.datetime.now() + datetime.timedelta(seconds=ttl_s)
        self.server.await_pull(uuid, [a for _, a, _ in arrays], timeout=until)
        return uuid

    # ------------------------------------------------------------------ decode side
    def specs(self, header_arrays) -> list:
        sh = jax.sharding.SingleDeviceSharding(self.device)
        return [jax.ShapeDtypeStruct(tuple(s["shape"]), jnp.dtype(s["dtype"]), sharding=sh) for s in header_arrays]

    def pull(self, address: str, uuid: int, specs) -> list:
        """Blocking pull (run it in a worker thread). Returns device arrays, ready."""
        with self._lock:
            conn = self._conns.get(address)
        if conn is None:
            conn = self.server.connect(address)
            with self._lock:
                self._conns[address] = conn
        out = conn.pull(uuid, list(specs))
        jax.block_until_ready(out)
        return out

    def forget(self, address: str):
        """Drop the connection to ``address`` (a pull on it timed out and may still be blocked)."""
        with self._lock:
            self._conns.pop(address, None)
