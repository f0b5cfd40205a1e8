"""Compatibility alias: the quantisation formats moved to ``dsflash.quant`` (below both model/ and kernels/).

``dsflash.model.quant`` is the very same module object (private names and monkeypatching included), kept so old
notebooks and scripts still import; new code imports ``from dsflash import quant``.
"""
import sys

from dsflash import quant as _quant

sys.modules[__name__] = _quant
