"""streamgr: a serving engine for generative recommendation models on CUDA streams.

``Engine`` is the embedded async facade; ``BlockingEngine`` its blocking wrapper. Request and
result types live in ``streamgr.api``, errors in ``streamgr.errors``.
"""

from .api import RankRequest, RankResult, RankStats
from .config import Spec, load_spec
from .engine import BlockingEngine, Engine

__version__ = "0.1.0"

__all__ = ["Engine", "BlockingEngine", "RankRequest", "RankResult", "RankStats", "Spec",
           "load_spec", "__version__"]
