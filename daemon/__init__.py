"""The specsched service: one engine behind a ZeroMQ ROUTER socket, the SQLite decision log, the CLI.

Modules by role (each file one role):

- protocol v1: ``protocol`` (the one import path) = ``messages`` (one dataclass per message type,
  error codes, limits) + ``codec`` (encode / decode) + ``wire_fields`` (field checks); torch-free, so
  the client library (``specsched.client``) imports it
- server: ``server`` (lifecycle, threads), ``io_thread`` (the ROUTER socket), ``serving`` (the engine
  thread), ``commands`` (IO -> engine thread), ``admission`` (the checks a generate passes),
  ``request_stream`` (text and stop strings of one request), ``stats_reply`` (the ``stats`` view),
  ``limits`` (``DaemonConfig``), ``auth`` + ``curve_keys`` (CURVE)
- decision log: ``log`` (``LogWriter``, the public names), ``log_store`` (the writer thread's SQLite
  side), ``log_config`` (``LogConfig``); the schema and reader are ``specsched.engine.log_schema``
- entry points: ``cli`` (``specsched-serve``, ``specsched-generate``), ``app_config`` (hydra schemas),
  ``summary`` (per-step decisions summary)

The engine itself (step loop, scheduler, requests, records) is ``specsched.engine``; the client
library is ``specsched.client``. ``from specsched.daemon import Client`` still works for this release
and warns: import it from ``specsched.client``.
"""

from __future__ import annotations

import warnings

_MOVED_TO_CLIENT = ("Client", "AsyncClient", "Completion")


def __getattr__(name: str):
    # deprecated lazy re-exports (importing the package stays light: no torch)
    if name in _MOVED_TO_CLIENT:
        warnings.warn(
            f"specsched.daemon.{name} moved to specsched.client.{name}; the old name goes next release",
            DeprecationWarning,
            stacklevel=2,
        )
        from specsched import client

        return getattr(client, name)
    raise AttributeError(f"module 'specsched.daemon' has no attribute {name!r}")
