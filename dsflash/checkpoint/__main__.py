"""``python -m dsflash.checkpoint FOLDER [--load]``: validate an official-layout checkpoint.

Without ``--load`` only the headers are read (seconds, even for the 510 GB release): names, shapes,
dtypes, shard files and their sizes. ``--load`` then streams every tensor onto the default device."""
import argparse
import json
import sys
import time


def main(argv=None) -> int:
    from dsflash.checkpoint.loader import CheckpointError, check_checkpoint, load_checkpoint

    ap = argparse.ArgumentParser(prog="python -m dsflash.checkpoint", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--load", action="store_true", help="also load every tensor (default device)")
    ap.add_argument("--host-tables", default="host", choices=("device", "host", "skip"),
                    help="with --load: where Engram tables go (default: host memmaps)")
    a = ap.parse_args(argv)
    try:
        summary = check_checkpoint(a.folder)
        print(json.dumps(summary, indent=2))
        if a.load:
            t = time.perf_counter()
            load_checkpoint(a.folder, host_tables=a.host_tables)
            dt = time.perf_counter() - t
            print(f"loaded in {dt:.1f} s ({summary['bytes'] / dt / 1e9:.2f} GB/s)")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
