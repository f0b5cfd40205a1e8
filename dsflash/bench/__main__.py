"""``python -m dsflash.bench <subcommand> [args]``: dispatch to dsflash/bench/<subcommand>.py ``main(argv)``
(a hyphen in the subcommand is an underscore in the module: ``scale-model`` -> ``scale_model.py``)."""
from __future__ import annotations

import importlib
import sys

from dsflash.bench import SUBCOMMANDS as _LISTED

# subcommands with a module that dsflash/bench/__init__.py does not list yet
SUBCOMMANDS = tuple(_LISTED) + tuple(n for n in ("forward", "eplb", "scale-model") if n not in _LISTED)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m dsflash.bench {{{'|'.join(SUBCOMMANDS)}}} [options]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"unknown subcommand {name!r}; choose one of {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    modname = f"dsflash.bench.{name.replace('-', '_')}"
    try:
        mod = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name == modname:
            print(f"subcommand {name!r} is not implemented yet (no {modname.replace('.', '/')}.py)", file=sys.stderr)
            return 2
        raise
    rc = mod.main(rest)
    return 0 if rc is None else int(rc)


if __name__ == "__main__":
    sys.exit(main())
