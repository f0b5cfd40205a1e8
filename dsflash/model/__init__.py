"""The DeepSeek-V4.1-Flash model as pure functions over a flat params dict (see docs/model-contract.md)."""
from dsflash.model.forward import forward
from dsflash.model.params import abstract_params, init_params, param_counts, param_specs
from dsflash.model.state import Batch, CacheGeometry, RunOptions, init_state, make_batch

__all__ = ["forward", "abstract_params", "init_params", "param_counts", "param_specs", "Batch", "CacheGeometry",
           "RunOptions", "init_state", "make_batch"]
