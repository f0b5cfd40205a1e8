"""Compatibility alias: the public API (``load``, ``Model``, ``SHIPPED``) moved to ``dsflash.api``, the floor above
model/ and checkpoint/. ``dsflash.model.api`` is the very same module object (monkeypatching included), kept so
old notebooks and scripts still import; new code imports ``dsflash.api``."""
import sys

from dsflash import api as _api

sys.modules[__name__] = _api
