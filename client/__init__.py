"""The specsched client library: ``Client`` (blocking) and ``AsyncClient`` (asyncio) for protocol v1.

Needs only pyzmq and msgpack (no torch, no transformers)::

    from specsched.client import Client

    with Client("tcp://127.0.0.1:5555") as client:
        print(client.generate("Hello", max_tokens=16).text)

Modules: ``sync_client`` (``Client`` and every public name, re-exported here), ``async_client``
(``AsyncClient``), ``core`` (sans-IO: requests, reply routing, reconnect bookkeeping, stream
assembly), ``transport`` (the DEALER socket), ``errors`` (typed errors). The message types come from
the protocol (``specsched.daemon.protocol``, torch-free).
"""

from __future__ import annotations

from specsched.client import sync_client
from specsched.client.sync_client import *  # noqa: F403 -- the public names (sync_client.__all__)

__all__ = list(sync_client.__all__)
