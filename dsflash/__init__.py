"""dsflash: DeepSeek-V4.1-Flash in JAX/XLA — the model, its checkpoint format and a serving engine.

The short face:
    ModelConfig, preset          configuration (official config.json <-> dataclass), presets
    load(path_or_preset, ...)    a Model for notebooks: logits(), forward(), propose()
    LLM, SamplingParams          offline engine API: LLM(...).generate(prompts, SamplingParams(...))
"""
import os as _os


def _faithful_xla_flags():
    """XLA may keep values in higher precision than the program says ("excess precision") and then drops
    the FP8/FP4 quantise-dequantise round trips that define the released numerics (measured on the H200:
    a jitted MoE differed from op-by-op by ~5%). Turn that off unless the user chose otherwise. XLA reads
    XLA_FLAGS when its backend starts, so this only takes effect if dsflash is imported first."""
    flags = _os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" not in flags:
        _os.environ["XLA_FLAGS"] = (flags + " --xla_allow_excess_precision=false").strip()


_faithful_xla_flags()

from dsflash.config import ModelConfig, preset  # noqa: E402
from dsflash.serve.types import RequestOutput, SamplingParams  # noqa: E402

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
