"""CUDA stream set, per-layer onload handles, pinned double-buffered onload and transient
offload pipelines, and their null twins for a cache without a host tier. On a CPU the same code
runs with streams as no-ops.

Imports kernels; must not import engine, protocol or server code.
"""

from .null import NullOffload, NullOnload
from .offload import OffloadDone, OffloadPipeline
from .onload import OnloadPipeline
from .streams import LayerOnloadHandles, OnloadFault, StreamSet, off_stream

__all__ = ["StreamSet", "LayerOnloadHandles", "OnloadFault", "OnloadPipeline", "OffloadPipeline",
           "OffloadDone",
           "NullOnload", "NullOffload", "off_stream"]
