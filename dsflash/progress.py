"""A progress bar for long host loops (checkpoint load, random init): tqdm when installed, else a no-op."""
from __future__ import annotations


class _NoBar:
    def __init__(self, *a, **k):
        pass

    def update(self, n):
        pass

    def set_postfix_str(self, *a, **k):
        pass

    def close(self):
        pass


def progress_bar(*args, disable=False, **kw):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but a bare environment should still load
        return _NoBar()
    return tqdm(*args, disable=disable, **kw)
