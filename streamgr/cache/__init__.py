"""The hierarchical user K/V cache (MTServe): metadata (page tables, LRU, locks, quota) in
``manager`` (pure Python, no tensors), the device page and host chunk stores in ``store``, and the
per-user event histories for delta requests in ``history``.

Must not import engine, protocol or server code.
"""

from .history import HistoryStore
from .manager import KVCacheManager, OffloadJob, UserEntry, UserPlan, fingerprint

__all__ = ["KVCacheManager", "OffloadJob", "UserEntry", "UserPlan", "HistoryStore", "fingerprint"]
