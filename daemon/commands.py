"""What the IO thread (server.py) hands the engine thread (serving.py) through its queue."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specsched.daemon.messages import Generate


@dataclass
class Admit:
    client: bytes  # ZMQ routing identity
    msg: Generate
    arrival_time: float  # time.time() when the IO thread received it
    received: float = field(default_factory=time.monotonic)  # the same moment; deadlines count from it
    # the prompt's token ids when the IO thread tokenized it (admission.tokenize_prompt); None: the
    # engine thread does (build_request)
    prompt_ids: list[int] | None = None


@dataclass
class CancelRequest:
    client: bytes
    id: str


@dataclass
class DropClient:
    """The client is unreachable: abort its requests without replying."""

    client: bytes


@dataclass
class Shutdown:
    grace_s: float  # let in-flight requests run this long, then abort the rest


Command = Admit | CancelRequest | DropClient | Shutdown
