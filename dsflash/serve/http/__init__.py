"""OpenAI-compatible HTTP API (FastAPI) over :class:`dsflash.serve.async_engine.AsyncEngine`."""
from dsflash.serve.http.app import build_app

__all__ = ["build_app"]
