"""Clients of the socket protocol: ``AsyncClient`` (pipelined) and the blocking ``Client``.

Both are made from an address (``"127.0.0.1:7700"``, ``"[::1]:7700"`` or ``"unix:/path"``) and
take the same request types as the embedded engine. Error replies raise the typed exception of
their code (``streamgr.errors``); a broken connection fails the calls in flight with
``ConnectionLost`` and the next call reconnects. An ``AsyncClient``'s connection belongs to the
event loop that made it (see ``AsyncClient._on_this_loop``).
"""

from __future__ import annotations

from ..errors import StreamgrError
from .async_client import AsyncClient
from .blocking import Client
from .wire import parse_address

__all__ = ["AsyncClient", "Client", "parse_address", "StreamgrError"]
