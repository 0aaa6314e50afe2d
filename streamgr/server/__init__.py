"""The uvloop socket server: connections, flow control, admission, shutdown, metrics.

Imports the engine and the protocol; the engine never imports this package.
"""

from .server import Server, ServerLimits

__all__ = ["Server", "ServerLimits"]
