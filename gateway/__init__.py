"""``specsched-gateway``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of the daemon.

A separate process that talks to the daemon over ZeroMQ as a protocol client (``specsched.client``);
it imports neither torch nor the engine. Modules by role: ``config`` (``GatewayConfig``), ``schemas``
(request bodies, OpenAI field names, and their mapping onto ``generate``), ``responses`` (the
``chat.completion`` / ``text_completion`` objects and SSE framing), ``errors`` (OpenAI error bodies,
the daemon's error codes mapped to HTTP statuses), ``streaming`` (client disconnects cancel the request),
``daemon_link`` (the client, the health probe), ``app`` (the routes, ``create_app``), ``cli`` (hydra).
Details: docs/gateway.md.
"""
