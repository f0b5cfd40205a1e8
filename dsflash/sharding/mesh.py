"""Device meshes from short specs, and multi-host initialisation.

A mesh spec is a comma-separated list of ``axis=size`` terms::

    "dep=2"        2 devices, attention data-parallel + experts expert-parallel over the same 2
    "dep=32"       wide-EP decode (NVL72-class)
    "tp=4"         tensor parallel (debug / small deployments)
    "dep=8,tp=2"   16 devices: attention DP over dep (heads over tp), experts over dep x tp
    "dep=-1"       fill: -1 (or "*") takes whatever the other axes leave of the device count

Known mesh axes, outermost (slowest interconnect) to innermost (fastest): ``dp`` (pure data
parallel: replicated experts), ``dep`` (data-parallel attention + expert parallel), ``ep`` (expert
parallel only), ``tp`` (tensor parallel). The mesh axes are always laid out in that order
whatever order the spec writes them in, so ``tp`` stays on neighbouring devices (one NVLink domain).

The product of the sizes must equal the number of devices given (``jax.devices()`` by default; pass
``devices=jax.devices()[:n]`` to use a subset). Faked CPU devices work the same way
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``).

Multi-host: call :func:`init_distributed` once per process **before** any other JAX call; afterwards
``jax.devices()`` lists the devices of all processes and ``make_mesh`` spans them.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

MESH_AXES = ("dp", "dep", "ep", "tp")


def parse_spec(spec: str, num_devices: int | None = None) -> dict[str, int]:
    """``"dep=8,tp=2"`` -> ``{"dep": 8, "tp": 2}`` in canonical axis order.

    ``num_devices`` resolves one ``-1``/``*`` size and is checked against the product."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh spec {spec!r}: expected terms like 'dep=8' or 'dep=8,tp=2'")
    sizes: dict[str, int] = {}
    fill = None
    for term in spec.replace(" ", "").split(","):
        if "=" not in term:
            raise ValueError(f"mesh spec {spec!r}: term {term!r} is not 'axis=size'")
        name, val = term.split("=", 1)
        if name not in MESH_AXES:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r}; known axes: {', '.join(MESH_AXES)}")
        if name in sizes or name == fill:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if val in ("-1", "*"):
            if fill is not None:
                raise ValueError(f"mesh spec {spec!r}: only one axis may be -1/*")
            fill = name
            continue
        try:
            n = int(val)
        except ValueError:
            raise ValueError(f"mesh spec {spec!r}: size {val!r} of axis {name!r} is not an integer") from None
        if n < 1:
            raise ValueError(f"mesh spec {spec!r}: size of axis {name!r} must be >= 1, got {n}")
        sizes[name] = n
    prod = int(np.prod(list(sizes.values()))) if sizes else 1
    if fill is not None:
        if num_devices is None:
            raise ValueError(f"mesh spec {spec!r}: a -1/* axis needs a device count")
        if num_devices % prod:
            raise ValueError(f"mesh spec {spec!r}: {num_devices} devices are not a multiple of {prod}")
        sizes[fill] = num_devices // prod
        prod = num_devices
    if num_devices is not None and prod != num_devices:
        raise ValueError(f"mesh spec {spec!r} needs {prod} devices but {num_devices} were given "
                         f"(pass devices=jax.devices()[:{prod}] to use a subset)")
    return {a: sizes[a] for a in MESH_AXES if a in sizes}


def make_mesh(spec: str, devices: Sequence | None = None) -> Mesh:
    """A :class:`jax.sharding.Mesh` (Auto axis types, so jit/GSPMD and shard_map both work)."""
    devs = list(jax.devices() if devices is None else devices)
    sizes = parse_spec(spec, len(devs))
    names = tuple(sizes)
    shape = tuple(sizes.values())
    try:
        return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devs)
    except Exception:  # device-topology-aware layout can refuse odd subsets; fall back to the given order
        return Mesh(np.asarray(devs, dtype=object).reshape(shape), names,
                    axis_types=(AxisType.Auto,) * len(names))


def abstract_mesh(spec: str) -> AbstractMesh:
    """A device-less mesh of the spec's shape (golden snapshots, validation of meshes bigger than this host)."""
    sizes = parse_spec(spec)
    return AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def mesh_sizes(mesh) -> dict[str, int]:
    """Axis name -> size for a Mesh, an AbstractMesh, a spec string or a dict."""
    if isinstance(mesh, str):
        return parse_spec(mesh)
    if isinstance(mesh, dict):
        return dict(mesh)
    return dict(zip(mesh.axis_names, mesh.axis_sizes if hasattr(mesh, "axis_sizes") else mesh.devices.shape))


def mesh_spec(mesh) -> str:
    """The canonical spec string of a mesh (``"dep=8,tp=2"``)."""
    return ",".join(f"{a}={n}" for a, n in mesh_sizes(mesh).items())


def init_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None,
                     local_device_ids: Sequence[int] | int | None = None, **kwargs) -> None:
    """Join a multi-process JAX job (one process per host, or several CPU processes on one machine).

    ``coordinator`` is ``"host:port"`` of process 0 (every process passes the same address),
    ``num_processes`` the job size and ``process_id`` this process's rank in ``[0, num_processes)``.
    Must run before any other JAX call in the process (it fixes the device list). Afterwards
    ``jax.devices()`` lists the devices of all processes, ``jax.local_devices()`` this process's, and
    ``make_mesh("dep=N")`` over ``jax.devices()`` spans the hosts; arrays are assembled from
    per-process shards with ``jax.make_array_from_process_local_data``.

    On CPU, cross-process collectives need ``jax.config.update("jax_cpu_collectives_implementation",
    "gloo")`` before this call (done here when the platform is forced to CPU). Calling again with the
    same arguments is a no-op. ``None`` leaves a value to ``jax.distributed.initialize``'s own lookup
    (``JAX_COORDINATOR_ADDRESS``, or what a launcher such as SLURM / Open MPI / mpi4py sets).
    """
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"init_distributed: process_id {process_id} not in [0, {num_processes})")
    if jax.distributed.is_initialized():
        if (num_processes is not None and jax.process_count() != num_processes) or \
                (process_id is not None and jax.process_index() != process_id):
            raise RuntimeError("init_distributed: already initialised with a different process layout "
                               f"(process {jax.process_index()} of {jax.process_count()})")
        return
    import os
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception:  # older/newer JAX without the option: local-only CPU collectives
            pass
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids, **kwargs)
