"""CURVE authentication for the daemon's socket, and the rule that only loopback binds may go without it.

CurveZMQ (ZeroMQ's CURVE mechanism, RFC 26; Curve25519 keys, Z85-encoded as 40 characters) encrypts
every connection and authenticates both ends: a client must know the server's public key, and the
server admits only clients whose public key it lists (checked by a ZAP handler, pyzmq's
``ThreadAuthenticator``, on the server's ZeroMQ context). A client that fails the handshake never gets
a message through: it sees no reply at all.

Key files are ZeroMQ certificates (the ZPL text format that ``zmq.auth.load_certificate`` reads): the
secret certificate (``<name>.key_secret``, mode 0600, holds both keys) and the public one
(``<name>.key``); curve_keys.py reads and writes them. ``python -m specsched.daemon.auth keygen PATH``
writes a pair. Secret keys are never logged, put in configs, or written to the decision log: configs
name files only.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
import threading
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from specsched.daemon.curve_keys import (
    KEY_CHARS,
    CurveKeys,
    KeyPair,
    check_key,
    public_key_path,
    read_client_keys,
    read_key_pair,
    read_public_key,
    write_key_pair,
)

logger = logging.getLogger(__name__)
ZAP_DOMAIN = "specsched"
LOOPBACK_NAMES = ("localhost", "lo")  # a host name / interface name that is loopback by definition
__all__ = [
    "KEY_CHARS",
    "LOOPBACK_NAMES",
    "ZAP_DOMAIN",
    "CurveKeys",
    "CurveServer",
    "KeyPair",
    "check_endpoint",
    "check_key",
    "endpoint_host",
    "is_loopback",
    "main",
    "public_key_path",
    "read_client_keys",
    "read_key_pair",
    "read_public_key",
    "write_key_pair",
]


# ---- endpoints -----------------------------------------------------------------------------------------


def endpoint_host(endpoint: str) -> str | None:
    """The interface a ``tcp://`` endpoint binds (``tcp://[::1]:5555`` -> ``::1``); None for others."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(endpoint: str) -> bool:
    """True for ``ipc://`` / ``inproc://`` (local to this machine) and for ``tcp://`` on a loopback
    address (127.0.0.0/8, ::1, ``localhost``, the ``lo`` interface). ``*``, 0.0.0.0 and any other
    host or interface count as reachable from outside."""
    host = endpoint_host(endpoint)
    if host is None:
        return True
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_endpoint(endpoint: str, curve: bool) -> None:
    """Refuse (``ValueError``) to bind a non-loopback endpoint without CURVE."""
    if not curve and not is_loopback(endpoint):
        raise ValueError(
            f"daemon.endpoint {endpoint!r} is not a loopback address: binding it requires CURVE "
            "authentication. Set daemon.curve=true, daemon.curve_key_file=<server secret key file> and "
            "the allowed client keys (daemon.curve_clients or daemon.curve_clients_file), or bind "
            "tcp://127.0.0.1:<port>. See docs/operations.md."
        )


# ---- the server side -------------------------------------------------------------------------------------


class _Allowlist:
    """ZAP credentials provider: admits the listed client keys, counts the rest."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys
        self.num_denied = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        if key.decode("ascii", "replace") in self.keys:
            return True
        with self._lock:
            self.num_denied += 1
            first = self.num_denied == 1
        if first:  # once: a scanner must not flood the log
            logger.warning("CURVE: refused a client key that is not allowed (counted in num_auth_denied)")
        return False


class CurveServer:
    """CURVE on the daemon's ROUTER: the server key pair (generated into ``key_file`` when missing) and a
    ZAP authenticator that admits ``clients``. ``secure(sock)`` before ``bind``; ``stop()`` at close."""

    def __init__(self, ctx: zmq.Context, key_file: str, clients: list[str], clients_file: str | None) -> None:
        if not Path(key_file).exists():
            pair = write_key_pair(key_file)
            logger.info(
                "CURVE: generated the server key pair %s (public: %s)", key_file, public_key_path(key_file)
            )
        else:
            pair = read_key_pair(key_file)
        allowed = [check_key(k, f"daemon.curve_clients[{i}]") for i, k in enumerate(clients)]
        if clients_file is not None:
            allowed += read_client_keys(clients_file)
        if not allowed:
            raise ValueError("daemon.curve is on but no client key is allowed (daemon.curve_clients / _file)")
        self.public_key = pair.public
        self._secret = pair.secret
        self._allowlist = _Allowlist(set(allowed))
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self._allowlist)
        logger.info("CURVE on: %d allowed client key(s)", len(self._allowlist.keys))

    @property
    def num_denied(self) -> int:
        return self._allowlist.num_denied

    def secure(self, sock: zmq.Socket) -> None:
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_server = True
        sock.curve_publickey = self.public_key.encode()
        sock.curve_secretkey = self._secret.encode()

    def stop(self) -> None:
        self._auth.stop()


# ---- python -m specsched.daemon.auth ------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specsched.daemon.auth", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    keygen = sub.add_parser("keygen", help="write a key pair: PATH (secret, 0600) and its public certificate")
    keygen.add_argument("path", help="secret certificate to create, e.g. server.key_secret (-> server.key)")
    show = sub.add_parser("public", help="print the public key of a certificate file")
    show.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "keygen":
            pair = write_key_pair(args.path)
            print(f"secret: {args.path}\npublic: {public_key_path(args.path)}\npublic key: {pair.public}")
        else:
            print(read_public_key(args.path))
    except (OSError, ValueError) as e:
        print(f"specsched: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
