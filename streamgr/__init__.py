"""streamgr: a serving engine for generative recommendation models on CUDA streams.

``Engine`` is the embedded async facade; ``BlockingEngine`` its blocking wrapper. Request and
result types live in ``streamgr.api``, errors in ``streamgr.errors``. The engine (and torch) is
imported on first use of ``Engine`` or ``BlockingEngine``, so a client-only program
(``streamgr.client``, the request types) never loads torch, numpy or CUDA.
"""

from .api import (GenerateRequest, GenerateResult, GenerateStats, RankRequest, RankResult,
                  RankStats)

__version__ = "0.1.0"

__all__ = ["Engine", "BlockingEngine", "RankRequest", "RankResult", "RankStats",
           "GenerateRequest", "GenerateResult", "GenerateStats", "Spec", "load_spec",
           "__version__"]

_LAZY = {"Engine": ".engine", "BlockingEngine": ".engine", "Spec": ".config",
         "load_spec": ".config"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'streamgr' has no attribute {name!r}")
