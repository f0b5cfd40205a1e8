"""Hot kernels. Each module holds a pure-JAX reference and (on GPU) a jax-triton kernel with the same
signature; ``backend="xla"`` picks the reference, ``backend="triton"`` the kernel. jax-triton is imported
lazily so the CPU path never needs it."""
BACKENDS = ("xla", "triton")
