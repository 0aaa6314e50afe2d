"""Public request, result and stats types of the embedded engine (``msgspec.Struct``s).

The socket protocol has its own wire structs (``streamgr.protocol.messages``); the client takes
and returns these, so a request built for the embedded engine goes to a server unchanged.
Imports msgspec only: the thin client uses these types without torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class RankRequest(msgspec.Struct, kw_only=True):
    """Rank ``candidates`` for a user whose history is ``items`` / ``actions`` (oldest first).

    By default the request carries the full history. In the delta form, ``base_len`` is the
    number of events the engine already saw for this user and ``items``/``actions`` hold only the
    events after them; an engine that no longer holds that prefix answers ``HistoryRequired``.
    Ids are lists of ints or 1-D numpy integer arrays: the engine reads an int64 array in place,
    and the socket client sends arrays as packed ids (docs/protocol.md), which the server reads
    in place too (a long history's list costs the server's loop ~0.26 ms at 3,500 events).
    """

    user_id: int | str
    items: list[int]
    actions: list[int]
    candidates: list[int]
    base_len: int | None = None  # delta form: events already sent in earlier requests


class RankStats(msgspec.Struct, kw_only=True):
    batch_size: int = 0
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    total_ms: float = 0.0
    history_tokens: int = 0  # whole history of the request, in tokens (2 per event)
    tokens_from_gpu: int = 0  # history tokens served from device pages
    tokens_from_host: int = 0  # history tokens onloaded from host chunks
    # held in host chunks but recomputed while the rest onloaded: cheaper (cache.onload_split)
    tokens_host_recomputed: int = 0
    tokens_recomputed: int = 0  # history tokens computed by the model this time
    tier: str = "miss"  # gpu | host | miss | none: where most of the cached history came from
    stages: dict[str, float] = msgspec.field(default_factory=dict)  # batch stage times, ms
    version: str = ""  # the rank weights version the request ran on
    replica: str = ""  # scale-out: the replica that answered (deploy/ray_serve.py)


class RankResult(msgspec.Struct, kw_only=True):
    scores: list[float]  # one per candidate, in request order
    stats: RankStats





class GenerateRequest(msgspec.Struct, kw_only=True):
    """Generate ``top_k`` items for a user from its item history (oldest first)."""

    user_id: int | str
    history: list[int]
    top_k: int
    beam_width: int | None = None  # applies to every step; default: the policy's widths
    # Selection variants (runtime/variants.py): per-step widths for this request (e.g. narrowing
    # [64, 32, 16]; excludes beam_width), items never to answer (a deny list), and at most this
    # many items per first SID code (0: no cap; None: the policy's max_per_prefix).
    beam_widths: list[int] | None = None
    exclude_items: list[int] | None = None
    max_per_prefix: int | None = None


class GenerateStats(msgspec.Struct, kw_only=True):
    batch_size: int = 0
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    total_ms: float = 0.0
    context_tokens: int = 0
    steps: dict[str, float] = msgspec.field(default_factory=dict)  # encoder/decoder/selection/compaction ms
    version: str = ""  # the generate version (weights, catalog, policy) the request ran on
    replica: str = ""  # scale-out: the replica that answered (deploy/ray_serve.py)


class GenerateResult(msgspec.Struct, kw_only=True):
    items: list[int]  # best first
    scores: list[float]  # summed log-probabilities of each item's SID
    # each item's SID codes. An engine's answers hold a ``runtime.sid_rows.SidRows``: a
    # sequence that reads, compares and pickles as this list of lists and makes it only when
    # first read (``.tolist()``; for json/msgspec encoders ``sid_rows.enc_hook``)
    sids: Sequence[list[int]]
    stats: GenerateStats
__all__ = ["RankRequest", "RankResult", "RankStats", "GenerateRequest", "GenerateResult", "GenerateStats"]
