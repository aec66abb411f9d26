"""The specsched daemon: engine, scheduler, server, protocol, client library, SQLite log, CLI.

The client library is importable from here without pulling in torch::

    from specsched.daemon import Client
"""

from __future__ import annotations


def __getattr__(name: str):
    # lazy re-exports: importing the package must stay light (the client needs no torch)
    if name in ("Client", "AsyncClient", "Completion"):
        from specsched.daemon import client

        return getattr(client, name)
    raise AttributeError(name)
