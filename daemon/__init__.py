"""The specsched daemon: engine, scheduler, server, protocol, client library, SQLite log, CLI.

The client library is importable from here without pulling in torch::

    from specsched.daemon import Client

Modules by role (each file one role):

- engine: ``engine`` (the step loop), ``scheduler``, ``request``, ``records``, ``components``, ``step_timer``,
  ``config``, ``stats`` (step counters for ``stats``)
- protocol v1: ``protocol`` (the one import path) = ``messages`` (one dataclass per message type,
  error codes, limits) + ``codec`` (encode / decode) + ``wire_fields`` (field checks)
- server: ``server`` (lifecycle, threads), ``io_thread`` (the ROUTER socket), ``serving`` (the engine
  thread), ``commands`` (IO -> engine thread), ``admission`` (the checks a generate passes),
  ``request_stream`` (text and stop strings of one request), ``limits`` (``DaemonConfig``),
  ``auth`` + ``curve_keys`` (CURVE)
- client: ``client`` (``Client``, the public names) and ``client_async`` (``AsyncClient``), thin shells
  around ``client_core`` (sans-IO) and ``client_socket`` (the DEALER socket); ``client_errors``
- decision log: ``log`` (``LogWriter``, the public names), ``log_store`` (the writer thread's SQLite
  side), ``log_schema`` (tables, config, ``open_log``)
- entry points: ``cli`` (``specsched-serve``, ``specsched-generate``), ``app_config`` (hydra schemas),
  ``summary`` (per-step decisions summary), ``settings`` (``SPECSCHED_*`` environment)
"""

from __future__ import annotations


def __getattr__(name: str):
    # lazy re-exports: importing the package must stay light (the client needs no torch)
    if name in ("Client", "AsyncClient", "Completion"):
        from specsched.daemon import client

        return getattr(client, name)
    raise AttributeError(name)
