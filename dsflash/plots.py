"""matplotlib for PNG plots, imported lazily (``pip install dsflash[bench]``), shared by bench/ and train/:
without it a plot is skipped with a warning and the JSON results are still written."""
from __future__ import annotations

import warnings


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` (with a warning) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'dsflash[bench]'); skipping the plot",
                      RuntimeWarning, stacklevel=3)
        return None
