"""CURVE authentication for the daemon's socket, and the rule that only loopback binds may go without it.

CurveZMQ (ZeroMQ's CURVE mechanism, RFC 26; Curve25519 keys, Z85-encoded as 40 characters) encrypts
every connection and authenticates both ends: a client must know the server's public key, and the
server admits only clients whose public key it lists (checked by a ZAP handler, pyzmq's
``ThreadAuthenticator``, on the server's ZeroMQ context). A client that fails the handshake never gets
a message through: it sees no reply at all.

Key files are ZeroMQ certificates (the ZPL text format that ``zmq.auth.load_certificate`` reads): the
secret certificate (``<name>.key_secret``, mode 0600, holds both keys) and the public one
(``<name>.key``). ``python -m specsched.daemon.auth keygen PATH`` writes a pair. Secret keys are never
logged, put in configs, or written to the decision log: configs name files only.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import os
import stat
import struct
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

logger = logging.getLogger(__name__)
ZAP_DOMAIN = "specsched"
LOOPBACK_NAMES = ("localhost", "lo")  # a host name / interface name that is loopback by definition
KEY_CHARS = 40  # a Z85-encoded 32-byte Curve25519 key

_BANNER = """#   specsched CURVE {kind} certificate, generated {when}
#   ZPL format (zmq.auth.load_certificate reads it).{warning}

metadata
curve
"""


def check_key(key: str | bytes, what: str) -> str:
    """``key`` as a Z85 string if it is a valid Curve25519 key; else ``ValueError`` naming ``what``."""
    text = key.decode("ascii", "replace") if isinstance(key, bytes) else key
    if not isinstance(text, str) or len(text) != KEY_CHARS:
        raise ValueError(f"{what}: a CURVE key is {KEY_CHARS} Z85 characters, got {len(text)}")
    try:
        if len(z85.decode(text)) != 32:
            raise ValueError
    except (ValueError, KeyError, struct.error):
        raise ValueError(f"{what}: not a Z85-encoded key") from None
    return text


@dataclass(frozen=True)
class KeyPair:
    public: str  # Z85
    secret: str = field(repr=False)  # Z85; never printed

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public.decode(), secret.decode())


@dataclass(frozen=True)
class CurveKeys:
    """What a client needs to talk to a CURVE daemon: the server's public key and its own key pair."""

    server_public: str
    public: str
    secret: str = field(repr=False)

    def __post_init__(self) -> None:
        check_key(self.server_public, "server_public")
        check_key(self.public, "public")
        check_key(self.secret, "secret")

    @classmethod
    def load(cls, server_public_file: str | os.PathLike, client_secret_file: str | os.PathLike) -> CurveKeys:
        """From the server's public certificate and the client's secret certificate."""
        pair = read_key_pair(client_secret_file)
        return cls(read_public_key(server_public_file), pair.public, pair.secret)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``connect``) a CURVE client of the server."""
        sock.curve_serverkey = self.server_public.encode()
        sock.curve_publickey = self.public.encode()
        sock.curve_secretkey = self.secret.encode()


# ---- key files ---------------------------------------------------------------------------------------


def public_key_path(secret_path: str | os.PathLike) -> Path:
    """The public certificate beside ``secret_path``: ``x.key_secret`` -> ``x.key``, else ``x`` + ``.pub``."""
    p = Path(secret_path)
    return p.with_name(p.name.removesuffix("_secret")) if p.name.endswith(".key_secret") else Path(f"{p}.pub")


def write_key_pair(secret_path: str | os.PathLike, pair: KeyPair | None = None) -> KeyPair:
    """Write a new key pair: the secret certificate at ``secret_path`` (created with mode 0600; an
    existing file is never overwritten) and the public one at :func:`public_key_path`."""
    pair = pair or KeyPair.generate()
    secret_path = Path(secret_path)
    secret_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    when = datetime.datetime.now().isoformat(timespec="seconds")
    warning = "\n#   SECRET: do not share this file or loosen its permissions (0600)."
    body = _BANNER.format(kind="secret", when=when, warning=warning)
    body += f'    public-key = "{pair.public}"\n    secret-key = "{pair.secret}"\n'
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, body.encode())
    finally:
        os.close(fd)
    public = _BANNER.format(kind="public", when=when, warning="") + f'    public-key = "{pair.public}"\n'
    target = public_key_path(secret_path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(public)
    os.replace(tmp, target)  # readers never see a half-written public key
    return pair


def read_key_pair(secret_path: str | os.PathLike) -> KeyPair:
    """Read a secret certificate; refuses one that group or others may read (like ssh does)."""
    path = Path(secret_path)
    if not path.is_file():
        raise ValueError(f"{path}: no such CURVE secret key file")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ValueError(
            f"{path}: CURVE secret key file is readable by others (mode {mode:04o}); run: chmod 600 {path}"
        )
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path}: holds no secret-key (is it the public certificate?)")
    return KeyPair(check_key(public, f"{path}: public-key"), check_key(secret, f"{path}: secret-key"))


def read_public_key(path: str | os.PathLike) -> str:
    """The public key of a certificate file (public or secret) or of a file holding just the key."""
    path = Path(path)
    text = path.read_text()
    if "public-key" in text:
        return check_key(zmq.auth.load_certificate(path)[0], f"{path}: public-key")
    return check_key(text.strip(), str(path))


def read_client_keys(location: str | os.PathLike) -> list[str]:
    """Allowed client keys from a file (a certificate, or one Z85 key per line: whatever follows the
    key, and a line that starts with ``#`` and is not a key, is a comment -- Z85 itself uses ``#``)
    or a directory (every ``*.key`` / ``*.pub`` certificate in it)."""
    path = Path(location)
    if path.is_dir():
        return [read_public_key(p) for p in sorted(path.iterdir()) if p.suffix in (".key", ".pub")]
    if not path.is_file():
        raise ValueError(f"{path}: no such file or directory of CURVE client keys")
    if "public-key" in path.read_text():
        return [read_public_key(path)]
    keys = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        token = (line.split() or [""])[0]
        try:
            keys.append(check_key(token, f"{path}:{n}"))
        except ValueError:
            if token and not token.startswith("#"):
                raise
    return keys


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
