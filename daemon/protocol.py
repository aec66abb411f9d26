"""Wire protocol v1: one msgpack map per ZeroMQ message, with ``"v": 1`` and ``"type"``.

One dataclass per message type (messages.py) and one codec (codec.py): :func:`encode` turns a message
into bytes, :func:`decode` turns a frame into a message or raises :class:`ProtocolError` naming the bad
field, using the field checks of wire_fields.py. Client -> server messages are validated strictly
(unknown fields rejected, ``bool`` is not an int, NaN/inf rejected); server -> client messages are read
leniently (unknown fields ignored) so that v1 servers may add fields. The full description for client
writers is docs/protocol.md. This module is the protocol's one import path: it re-exports all three.
"""

from __future__ import annotations

from specsched.daemon import messages, wire_fields
from specsched.daemon.codec import decode, encode
from specsched.daemon.messages import *  # noqa: F403 -- the message types, codes and limits (messages.__all__)
from specsched.daemon.wire_fields import *  # noqa: F403 -- the field checks (wire_fields.__all__)

__all__ = [*messages.__all__, *wire_fields.__all__, "decode", "encode"]
