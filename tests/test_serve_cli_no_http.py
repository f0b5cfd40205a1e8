"""``python -m dsflash.serve``'s argument parser and engine factory must not need the HTTP stack: the GPU image has
no fastapi / uvicorn, and tests/gpu/test_engine_kernels.py builds the engine exactly as the server does (it failed
there on 2026-12-01 with ``ModuleNotFoundError: fastapi`` from the P/D options' module)."""
import subprocess
import sys

CODE = """
import builtins
real = builtins.__import__
def guarded(name, *a, **k):
    if name.split('.')[0] in ('fastapi', 'uvicorn', 'starlette'):
        raise ModuleNotFoundError(name)
    return real(name, *a, **k)
builtins.__import__ = guarded
from dsflash.serve.__main__ import build_parser, make_engine_factory
args = build_parser().parse_args(['--model', 'tiny', '--role', 'both'])
assert args.backend == 'auto' and args.kv_load_failure_policy == 'fail'
assert callable(make_engine_factory(args))
print('ok')
"""


def test_serve_parser_and_engine_factory_import_without_fastapi():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
