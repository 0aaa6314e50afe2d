"""The socket protocol: wire structs, framing and codec only.

Imports nothing from the engine, server or client; they import it.
"""

from .framing import DEFAULT_MAX_FRAME, HEADER, Codec, FrameTooLarge, read_frame
from .messages import (PROTOCOL_VERSION, Error, GenerateReply, GenerateRequest, Hello, HelloAck,
                       Message, RankReply, RankRequest, StatsReply, StatsRequest)

__all__ = ["PROTOCOL_VERSION", "DEFAULT_MAX_FRAME", "HEADER", "Codec", "FrameTooLarge",
           "read_frame", "Message", "Hello", "HelloAck", "RankRequest", "RankReply",
           "GenerateRequest", "GenerateReply", "StatsRequest", "StatsReply", "Error"]
