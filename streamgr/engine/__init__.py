"""The engine: the embedded async facade; admission, batching and the request lifecycle.

Never touches sockets; imports models, kernels, cache and runtime, never server or protocol.
"""

from .blocking import BlockingEngine
from .core import Engine

__all__ = ["Engine", "BlockingEngine"]
