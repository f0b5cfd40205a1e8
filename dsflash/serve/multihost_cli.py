"""The command-line face of multi-controller serving (docs/multihost.md): ``--coordinator``, ``--num-processes``,
``--process-id`` (each may instead come from what ``jax.distributed.initialize`` reads itself:
``JAX_COORDINATOR_ADDRESS``, or a launcher's environment such as SLURM / Open MPI / mpi4py) and
``--step-timeout``. ``join(...)`` checks them, naming the flag on bad input, and joins the job before any other
JAX call."""
from __future__ import annotations

import argparse
import os


def add_cli_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-controller serving (jax.distributed; docs/multihost.md)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordination service, the same on every process (default: "
                        "$JAX_COORDINATOR_ADDRESS or the launcher's). Process 0 serves HTTP and schedules; the "
                        "others follow its steps on the global mesh (--mesh must span all processes' devices)")
    g.add_argument("--num-processes", type=int, default=None,
                   help="processes in the job (default: the launcher's, e.g. SLURM / Open MPI)")
    g.add_argument("--process-id", type=int, default=None,
                   help="this process's rank in [0, --num-processes) (default: the launcher's)")
    g.add_argument("--step-timeout", type=float, default=300.0,
                   help="leader: seconds one step (broadcast + device calls) may take before a follower counts as "
                        "lost; in-flight requests then fail and the server exits with status 1")


def wants_multi_controller(args, environ=os.environ) -> bool:
    """Any of the three flags, or JAX's own coordinator variable, asks for a ``jax.distributed`` job."""
    return (args.coordinator is not None or args.num_processes is not None or args.process_id is not None
            or bool(environ.get("JAX_COORDINATOR_ADDRESS")))


def check(args) -> None:
    """Bad values -> ValueError naming the flag (before anything starts)."""
    n, i, c = args.num_processes, args.process_id, args.coordinator
    if n is not None and n < 1:
        raise ValueError(f"--num-processes: {n} (must be >= 1)")
    if i is not None and i < 0:
        raise ValueError(f"--process-id: {i} (must be >= 0)")
    if n is not None and i is not None and i >= n:
        raise ValueError(f"--process-id: {i} is not in [0, --num-processes {n})")
    if c is not None:
        host, sep, port = c.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator: {c!r} is not HOST:PORT (e.g. 10.0.0.1:1234)")
    if args.step_timeout <= 0:
        raise ValueError(f"--step-timeout: {args.step_timeout:g} (must be > 0)")


def join(args) -> bool:
    """Join the ``jax.distributed`` job the flags describe; False when none is asked for. ValueError names the
    flag that is missing or wrong (JAX's own messages are mapped to the flags)."""
    check(args)
    if not wants_multi_controller(args):
        return False
    from dsflash.sharding.mesh import init_distributed
    try:
        init_distributed(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        text = str(e)
        for needle, flag in (("coordinator_address", "--coordinator"), ("Number of processes", "--num-processes"),
                             ("process id", "--process-id"), ("process_id", "--process-id")):
            if needle in text:
                raise ValueError(f"{flag}: required for a multi-controller job and not found in the environment "
                                 f"either ({text})") from None
        raise
    return True
