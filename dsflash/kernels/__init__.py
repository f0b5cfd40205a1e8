"""Hot kernels. Each module holds a pure-JAX reference and (on GPU) a jax-triton kernel with the same
signature; which one runs is decided in one place, ``dsflash.kernels.dispatch`` (backend "auto" | "xla" |
"triton", the platform check and the measured crossover tables). jax-triton is imported lazily so the CPU path
never needs it."""
from dsflash.kernels.dispatch import BACKENDS  # noqa: F401
