"""Typed errors of streamgr.

Every error a caller can act on has its own class and a stable ``code`` (the same codes travel
on the wire protocol). Request errors leave the engine serving; ``EngineDead`` is the one error
that means the engine cannot serve any more.
"""

from __future__ import annotations


class StreamgrError(Exception):
    """Base of every streamgr error. ``code`` is a stable upper-case name."""

    code = "INTERNAL"


# -- configuration and artifacts ------------------------------------------------------------

class SpecError(StreamgrError, ValueError):
    """A deployment spec (or an override of it) is invalid; the message names the key."""

    code = "BAD_SPEC"


class CheckpointError(StreamgrError, ValueError):
    """A checkpoint directory is missing, unreadable or does not match its config."""

    code = "BAD_CHECKPOINT"


class ContractError(StreamgrError, ValueError):
    """An artifact does not satisfy the deployment contract; the message names the field."""

    code = "CONTRACT_MISMATCH"


# -- per request ----------------------------------------------------------------------------

class InvalidRequest(StreamgrError, ValueError):
    """A request is malformed. Subclasses say how; the engine keeps serving."""

    code = "INVALID_REQUEST"


class EmptyCandidates(InvalidRequest):
    code = "EMPTY_CANDIDATES"


class TooManyCandidates(InvalidRequest):
    code = "TOO_MANY_CANDIDATES"


class LengthMismatch(InvalidRequest):
    """``items`` and ``actions`` of a history differ in length."""

    code = "LENGTH_MISMATCH"


class IdOutOfRange(InvalidRequest):
    """An item, action or token id lies outside the model's embedding table."""

    code = "ID_OUT_OF_RANGE"


class HistoryTooLong(InvalidRequest):
    code = "HISTORY_TOO_LONG"


class HistoryRequired(InvalidRequest):
    """A delta request named a cached prefix the engine no longer holds: resend the full history."""

    code = "HISTORY_REQUIRED"


class UnsupportedRequest(InvalidRequest):
    """The engine's spec does not serve this kind of request (e.g. generate on a rank-only spec)."""

    code = "UNSUPPORTED"


# -- per call / engine state ------------------------------------------------------------------

class Overloaded(StreamgrError):
    code = "OVERLOADED"


class DeadlineExceeded(StreamgrError):
    code = "DEADLINE_EXCEEDED"


class EngineClosed(StreamgrError):
    """The engine is not started, is shutting down, or was closed."""

    code = "ENGINE_CLOSED"


class WrongEventLoop(StreamgrError, RuntimeError):
    """The engine was called from an event loop (or thread) other than the one it was started
    on. Its queues and futures belong to that loop: call it there (``BlockingEngine`` or
    ``asyncio.run_coroutine_threadsafe`` from other threads)."""

    code = "WRONG_EVENT_LOOP"


class ConnectionLost(StreamgrError):
    """The client's connection to the server broke with the request unanswered (retry is safe
    for rank, which has no side effects beyond the cache)."""

    code = "CONNECTION_LOST"


class ServerUnavailable(ConnectionLost):
    """No server answers at the client's address (refused, no such socket, unreachable)."""


class ProtocolError(StreamgrError):
    """The peer broke the wire protocol (bad frame, wrong version or token, oversize frame)."""

    code = "PROTOCOL_ERROR"


class ReplicaUnavailable(StreamgrError):
    """The replica serving the request went away (scale-out on Ray Serve) and a retry on the
    next replica failed too: retrying later is safe (rank and generate are idempotent)."""

    code = "UNAVAILABLE"


class Unauthorized(StreamgrError):
    """The connection's token does not allow this (a wrong token in Hello; an admin request
    without the admin token)."""

    code = "UNAUTHORIZED"


class EngineDead(StreamgrError):
    """The engine hit an unrecoverable fault (e.g. a CUDA error) and cannot serve any more."""

    code = "ENGINE_DEAD"


def _all_error_classes() -> dict[str, type[StreamgrError]]:
    out: dict[str, type[StreamgrError]] = {}
    stack = [StreamgrError]
    while stack:
        cls = stack.pop()
        out.setdefault(cls.code, cls)
        stack.extend(cls.__subclasses__())
    return out


ERROR_CLASSES: dict[str, type[StreamgrError]] = _all_error_classes()


def error_for_code(code: str, message: str) -> StreamgrError:
    """The typed exception for a wire error code (unknown codes map to ``StreamgrError``)."""
    cls = ERROR_CLASSES.get(code, StreamgrError)
    err = cls(message)
    if cls is StreamgrError:
        err.code = code
    return err
