"""The P/D command-line options of ``python -m dsflash.serve`` (docs/pd.md). Apart from ``pd/server.py`` so that
building the server's argument parser needs no HTTP stack (a GPU image without fastapi can still build the
engine exactly as the server would)."""
from __future__ import annotations

import argparse

POLICIES = ("fail", "recompute")


def add_cli_arguments(parser) -> None:
    g = parser.add_argument_group("P/D disaggregation (docs/pd.md)")
    g.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                   help="'both' = the aggregated server; 'prefill' holds KV for remote decode after 1 output "
                        "token; 'decode' pulls KV from a prefill instance (put `python -m dsflash.serve.router` "
                        "in front)")
    g.add_argument("--kv-ttl", type=float, default=480.0,
                   help="prefill role: seconds held KV waits for the decode side before it is freed")
    g.add_argument("--kv-load-failure-policy", default="fail", choices=list(POLICIES),
                   help="decode role: default when a request does not say: 'fail' (error the request) or "
                        "'recompute' (prefill it locally)")
    g.add_argument("--kv-pull-timeout", type=float, default=60.0, help="decode role: seconds for one KV pull")
    g.add_argument("--kv-transport", default="auto", choices=["auto", "transfer", "http"],
                   help="prefill/decode roles: how KV bytes move (the control plane is HTTP either way): "
                        "'transfer' = device to device through jax.experimental.transfer, 'http' = one host-staged "
                        "HTTP body; 'auto' = transfer when jax.experimental.transfer is available, else http "
                        "(the choice is logged at start)")
    g.add_argument("--kv-transfer-host", default=None,
                   help="prefill role, --kv-transport transfer: interface the transfer server binds (default: "
                        "--host); decode instances connect to it at the host of the peer's URL in --pd-peers")
    g.add_argument("--pd-test-hooks", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--pd-secret-file", default=None,
                   help="prefill/decode roles (required, or --pd-secret / $DSFLASH_PD_SECRET): file holding the shared "
                        "P/D secret (>= 16 bytes) also given to the router; authenticates KV transfer parameters, "
                        "requests between instances and KV bodies (docs/pd.md 'Deployment and trust')")
    g.add_argument("--pd-secret", default=None,
                   help="the shared P/D secret itself (visible in the process list: prefer --pd-secret-file)")
    g.add_argument("--pd-peers", default=None,
                   help="decode role (required): comma-separated host:port of the prefill instances this one may pull "
                        "KV from (the addresses the router reaches them at); nothing else is ever connected to")


def trust_from_args(args):
    """The ``PDTrust`` of a prefill/decode server (``None`` for ``--role both``); raises ``ValueError`` with the
    message to print when the P/D secret (or, for decode, ``--pd-peers``) is missing or invalid."""
    role = getattr(args, "role", "both")
    if role == "both":
        return None
    from dsflash.serve.pd.trust import SECRET_ENV, PDTrust, load_secret, parse_peers
    secret = load_secret(getattr(args, "pd_secret", None), getattr(args, "pd_secret_file", None))
    if secret is None:
        raise ValueError(f"--role {role} needs the shared P/D secret (--pd-secret-file FILE, --pd-secret or "
                         f"${SECRET_ENV}; the same one the router gets): without it anybody who can reach this "
                         f"port could make it pull or hand out KV (docs/pd.md 'Deployment and trust')")
    peers = parse_peers(getattr(args, "pd_peers", None) or "")
    if role == "decode" and not peers:
        raise ValueError("--role decode needs --pd-peers host:port,... (the prefill instances it may pull KV from)")
    return PDTrust(secret, peers)


def transport_from_args(args) -> tuple[str, str]:
    """(``transfer`` | ``http``, why) for a prefill/decode server; ``ValueError`` if ``transfer`` was asked for
    and cannot work here."""
    from dsflash.serve.pd.device_transfer import choose_transport
    return choose_transport(getattr(args, "kv_transport", "auto"))
