"""The wire messages of the streamgr socket protocol (see docs/protocol.md).

Every message is a ``msgspec.Struct`` encoded as a MessagePack *array*: ``[tag, field1, ...]``
with a small integer tag. Required fields come first; fields added by later protocol versions
are appended with defaults, so older peers can decode newer frames. Never pickle.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

PROTOCOL_VERSION = 1

# A request id: chosen by the client, echoed by the reply; 0 is reserved for "no request".
RequestId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class _Msg(msgspec.Struct, array_like=True, tag_field="t", kw_only=False):
    pass


class Hello(_Msg, tag=1):
    version: int
    token: str = ""  # shared secret, when the server requires one
    client: str = ""  # free-form client name, for logs


class HelloAck(_Msg, tag=2):
    version: int
    server: str  # "streamgr/<version>"
    model: str  # the spec's name
    max_frame: int  # bytes, body only
    max_inflight: int  # requests in flight across the server before OVERLOADED
    capabilities: list[str] = msgspec.field(default_factory=list)  # "rank", "generate", "stats"
    # rank and generate requests in flight on one connection before OVERLOADED (0: not said)
    max_conn_inflight: int = 0


# A server that lists this capability takes a RankRequest's ids and a GenerateRequest's history
# also as *packed ids*: a MessagePack bin of little-endian int64 values (a client sends numpy
# arrays so). A long history then costs the server a bounds check, not a list decode and a
# conversion (3,500 events: 11 us of its loop against 259, tools/bench_protocol.py --ids).
CAP_PACKED_IDS = "packed-ids"
Ids = Union[list[int], bytes]


class RankRequest(_Msg, tag=3):
    id: RequestId
    user_id: Union[int, str]
    items: Ids  # a list of ints, or packed ids (CAP_PACKED_IDS)
    actions: Ids
    candidates: Ids
    base_len: Union[int, None] = None  # delta form: events already sent before
    deadline_ms: Union[float, None] = None  # relative to receipt; DEADLINE_EXCEEDED after


class RankReply(_Msg, tag=4):
    id: RequestId
    scores: list[float]
    stats: dict[str, Any] = msgspec.field(default_factory=dict)


class GenerateRequest(_Msg, tag=5):
    id: RequestId
    user_id: Union[int, str]
    history: Ids  # item ids, oldest first (a list, or packed ids: CAP_PACKED_IDS)
    top_k: int
    beam_width: Union[int, None] = None
    deadline_ms: Union[float, None] = None
    beam_widths: Union[list[int], None] = None  # selection variants: see api.GenerateRequest
    exclude_items: Union[list[int], None] = None
    max_per_prefix: Union[int, None] = None


class GenerateReply(_Msg, tag=6):
    id: RequestId
    items: list[int]
    scores: list[float]
    sids: list[list[int]]
    stats: dict[str, Any] = msgspec.field(default_factory=dict)


class StatsRequest(_Msg, tag=7):
    id: RequestId


class StatsReply(_Msg, tag=8):
    id: RequestId
    stats: dict[str, Any]


class Error(_Msg, tag=9):
    id: RequestId  # the request's id; 0 when the frame could not be tied to a request
    code: str  # see streamgr.errors: INVALID_REQUEST, OVERLOADED, DEADLINE_EXCEEDED, ...
    message: str


class HealthRequest(_Msg, tag=10):
    id: RequestId


class HealthReply(_Msg, tag=11):
    """The answers of the metrics port's ``/health`` and ``/ready``."""

    id: RequestId
    live: bool  # the server answers
    ready: bool  # the model is loaded, the engine alive, the server not draining
    status: str  # "ready", "draining", "engine dead", ...


class UpdateRequest(_Msg, tag=12):
    """Admin (a connection greeted with the admin token): a live update of the engine's
    weights, catalog and/or policy (``Engine.update``). Paths name files on the server's host."""

    id: RequestId
    target: str = "auto"  # "auto" | "rank" | "generate"
    weights: Union[str, None] = None  # a checkpoint directory
    seed: Union[int, None] = None  # or random weights of this seed
    catalog: Union[str, None] = None  # a catalog file: full replacement
    catalog_add: dict[int, list[int]] = msgspec.field(default_factory=dict)  # item -> SID
    catalog_remove: list[int] = msgspec.field(default_factory=list)
    policy: dict[str, Any] = msgspec.field(default_factory=dict)  # fields of PolicySpec
    keep_previous: bool = True


class RollbackRequest(_Msg, tag=13):
    """Admin: back to the version kept by the last update."""

    id: RequestId
    target: str = "auto"


class VersionsRequest(_Msg, tag=14):
    """Admin: the active and kept versions."""

    id: RequestId


class VersionsReply(_Msg, tag=15):
    """The answer to the three admin requests: ``Engine.versions()`` after the change."""

    id: RequestId
    versions: dict[str, Any]


# A server that lists this capability takes Cancel.
CAP_CANCEL = "cancel"


class Cancel(_Msg, tag=16):
    """Withdraw this connection's rank or generate request ``id`` (its caller gave up: a
    timeout, a cancelled task): if still queued it never runs. Neither the Cancel nor the
    request is answered; an id not in flight (answered already, unknown) is ignored."""

    id: RequestId


Message = Union[Hello, HelloAck, RankRequest, RankReply, GenerateRequest, GenerateReply,
                StatsRequest, StatsReply, Error, HealthRequest, HealthReply, UpdateRequest,
                RollbackRequest, VersionsRequest, VersionsReply, Cancel]
ADMIN = (UpdateRequest, RollbackRequest, VersionsRequest)
REQUESTS = (RankRequest, GenerateRequest, StatsRequest, HealthRequest, Cancel) + ADMIN

# Codes that only the protocol layer produces (the engine's live in streamgr.errors).
BAD_FRAME = "BAD_FRAME"  # not MessagePack, or not a message at all: the connection closes
FRAME_TOO_LARGE = "FRAME_TOO_LARGE"  # declared length over max_frame: refused unread, closes
UNAUTHORIZED = "UNAUTHORIZED"  # wrong token or version in Hello (closes); an admin request
# on a connection without the admin token (the connection stays)
PROTOCOL_ERROR = "PROTOCOL_ERROR"  # a message the server does not take here (e.g. no Hello)
