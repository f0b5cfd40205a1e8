"""Benchmarks: ``python -m dsflash.bench kernels|engine|forward|serve ...`` (one module per subcommand, each
with ``main(argv)``). Results are JSON under benchmarks/results/ and headline rows in benchmarks/BENCHMARKS.md."""
SUBCOMMANDS = ("kernels", "engine", "forward", "serve", "guided")
