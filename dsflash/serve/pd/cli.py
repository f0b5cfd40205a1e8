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
    g.add_argument("--pd-test-hooks", action="store_true", help=argparse.SUPPRESS)
