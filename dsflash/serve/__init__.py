"""Serving: the engine (``dsflash.serve.engine``), its asyncio wrapper (``async_engine``), the
OpenAI-compatible HTTP API (``http``) and ``python -m dsflash.serve``.

Imports are lazy so that ``dsflash.serve.types`` (used by the offline API) does not pull in
FastAPI or the engine.
"""
from __future__ import annotations

__all__ = ["AsyncEngine", "build_app", "SamplingParams", "RequestOutput"]


def __getattr__(name):
    if name == "AsyncEngine":
        from dsflash.serve.async_engine import AsyncEngine
        return AsyncEngine
    if name == "build_app":
        from dsflash.serve.http.app import build_app
        return build_app
    if name in ("SamplingParams", "RequestOutput"):
        from dsflash.serve import types
        return getattr(types, name)
    raise AttributeError(f"module 'dsflash.serve' has no attribute {name!r}")
