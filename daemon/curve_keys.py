"""CURVE keys: Z85 key checks, the key pairs a server and a client hold, and their files.

Key files are ZeroMQ certificates (the ZPL text format that ``zmq.auth.load_certificate`` reads): the
secret certificate (``<name>.key_secret``, mode 0600, holds both keys) and the public one
(``<name>.key``). Secret keys are never logged, put in configs, or written to the decision log: configs
name files only. auth.py (which re-exports all of this) enforces CURVE on the daemon's socket.
"""

from __future__ import annotations

import datetime
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

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
