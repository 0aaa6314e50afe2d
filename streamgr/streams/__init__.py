"""CUDA stream set, per-layer onload handles, pinned double-buffered onload and transient
offload pipelines. On a CPU the same code runs with streams as no-ops.

Imports kernels; must not import engine, protocol or server code.
"""

from .offload import OffloadPipeline
from .onload import OnloadPipeline
from .streams import LayerOnloadHandles, OnloadFault, StreamSet

__all__ = ["StreamSet", "LayerOnloadHandles", "OnloadFault", "OnloadPipeline", "OffloadPipeline"]
