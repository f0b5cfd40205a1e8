"""Prefill/decode disaggregation (docs/pd.md): ``--role prefill|decode`` servers and the KV transfer.

* ``transfer.py``: what moves (global KV entries of the prompt + in-window per-slot rows) and the wire format
* ``device_transfer.py``: the ``--kv-transport transfer`` data plane (``jax.experimental.transfer``: offer, pull,
  fingerprint); the HTTP body stays as the fallback
* ``engine.py``: ``PDEngine`` (hold / extract / release on prefill, install on decode) and ``PDAsyncEngine``
* ``server.py``: the ASGI middleware and ``/pd/*`` routes added to the OpenAI app
The router is ``dsflash/serve/router.py`` (``python -m dsflash.serve.router``).
"""
