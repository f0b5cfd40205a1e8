"""dsflash: DeepSeek-V4.1-Flash in JAX/XLA — the model, its checkpoint format and a serving engine.

The short face:
    ModelConfig, preset          configuration (official config.json <-> dataclass), presets
    load(path_or_preset, ...)    a Model for notebooks: logits(), forward(), propose()
    LLM, SamplingParams          offline engine API: LLM(...).generate(prompts, SamplingParams(...))
"""
from dsflash.config import ModelConfig, preset
from dsflash.serve.types import RequestOutput, SamplingParams

__version__ = "0.1.0"


def load(*args, **kwargs):
    """See :func:`dsflash.model.api.load`."""
    from dsflash.model.api import load as _load
    return _load(*args, **kwargs)


def __getattr__(name):
    if name == "LLM":
        from dsflash.llm import LLM
        return LLM
    if name == "Model":
        from dsflash.model.api import Model
        return Model
    raise AttributeError(f"module 'dsflash' has no attribute {name!r}")


__all__ = ["ModelConfig", "preset", "load", "LLM", "SamplingParams", "RequestOutput", "__version__"]
