"""The hierarchical user K/V cache (MTServe): metadata in ``manager`` (pure Python, no tensors:
batches as leases, validation, eviction) built from ``pools`` (free pages and chunks),
``residency`` (the LRU lists) and ``offload_plan`` (offload jobs under the quota); the device
page and host chunk stores in ``store``, and the per-user event histories for delta requests in
``history``.

Must not import engine, protocol or server code.
"""

from .history import HistoryStore
from .manager import KVCacheManager, OffloadJob, UserEntry, UserPlan, fingerprint

__all__ = ["KVCacheManager", "OffloadJob", "UserEntry", "UserPlan", "HistoryStore", "fingerprint"]
