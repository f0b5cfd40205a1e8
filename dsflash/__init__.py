"""dsflash: DeepSeek-V4.1-Flash in JAX/XLA — the model, its checkpoint format and a serving engine.

The short face:
    ModelConfig, preset          configuration (official config.json <-> dataclass), presets
    load(path_or_preset, ...)    a Model for notebooks: logits(), forward(), propose()
    LLM, SamplingParams          offline engine API: LLM(...).generate(prompts, SamplingParams(...))
"""
# Numerics are protected per compiled program (dsflash.compile_options.jit); this process-wide XLA_FLAGS fallback
# stays until every program dsflash compiles goes through there (why, and how to remove it: that module).
from dsflash import compile_options as _compile_options

_compile_options.protect_process_default()

from dsflash.config import ModelConfig, preset  # noqa: E402
from dsflash.serve.types import RequestOutput, SamplingParams  # noqa: E402

__version__ = "0.1.0"


def load(*args, **kwargs):
    """See :func:`dsflash.api.load`."""
    from dsflash.api import load as _load
    return _load(*args, **kwargs)


def __getattr__(name):
    if name == "LLM":
        from dsflash.llm import LLM
        return LLM
    if name == "Model":
        from dsflash.api import Model
        return Model
    raise AttributeError(f"module 'dsflash' has no attribute {name!r}")


__all__ = ["ModelConfig", "preset", "load", "LLM", "SamplingParams", "RequestOutput", "__version__"]
