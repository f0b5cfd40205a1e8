"""The inference engine: paged caches with a prefix cache, a continuous-batching scheduler, compiled
prefill buckets and an on-device draft-and-verify decode loop (docs/engine.md)."""
from dsflash.serve.engine.config import EngineConfig
from dsflash.serve.engine.engine import LLMEngine
from dsflash.serve.engine.metrics import EngineMetrics

__all__ = ["LLMEngine", "EngineConfig", "EngineMetrics"]
