"""Authentication: loopback by default; any other bind needs CURVE, or the daemon refuses to start.
With CURVE (forced on loopback here; no traffic ever goes to a non-loopback address), only listed
client keys are served, and no key ever reaches the decision log."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys

import msgpack
import pytest
import zmq

from specsched.client.sync_client import AuthenticationFailed, Client
from specsched.daemon.auth import (
    CurveKeys,
    KeyPair,
    check_endpoint,
    is_loopback,
    main,
    public_key_path,
    read_client_keys,
    read_key_pair,
    read_public_key,
    write_key_pair,
)
from specsched.daemon.limits import DaemonConfig


@pytest.mark.parametrize(
    "endpoint, loopback",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.8.9.10:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://lo:5555", True),
        ("ipc:///tmp/specsched.sock", True),
        ("inproc://x", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://*:*", False),
        ("tcp://[::]:5555", False),
        ("tcp://10.0.0.1:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://example.org:5555", False),
    ],
)
def test_what_counts_as_loopback(endpoint, loopback):
    assert is_loopback(endpoint) is loopback
    if loopback:
        check_endpoint(endpoint, curve=False)
    else:
        with pytest.raises(ValueError, match="not a loopback address: binding it requires CURVE"):
            check_endpoint(endpoint, curve=False)
        check_endpoint(endpoint, curve=True)


def test_daemon_config_auth_rules(tmp_path):
    with pytest.raises(ValueError, match=r"tcp://0\.0\.0\.0:5555.*requires CURVE.*daemon\.curve=true"):
        DaemonConfig(endpoint="tcp://0.0.0.0:5555")
    with pytest.raises(ValueError, match="needs daemon.curve_key_file"):
        DaemonConfig(endpoint="tcp://0.0.0.0:5555", curve=True)
    with pytest.raises(ValueError, match="allowed client public keys"):
        DaemonConfig(curve=True, curve_key_file=str(tmp_path / "s.key_secret"))
    with pytest.raises(ValueError, match=r"daemon\.curve_clients\[1\]: a CURVE key is 40"):
        DaemonConfig(curve=True, curve_key_file="k", curve_clients=[KeyPair.generate().public, "short"])
    DaemonConfig(endpoint="tcp://0.0.0.0:5555", curve=True, curve_key_file="k", curve_clients_file="f")


def test_server_refuses_a_non_loopback_bind_without_curve_even_when_the_config_was_changed():
    from specsched.daemon.server import Server

    cfg = DaemonConfig(send_pace="loop")  # no engine here to pace sends by (send_pace=step hooks it)
    cfg.endpoint = "tcp://0.0.0.0:0"  # after validation
    server = Server(engine=None, cfg=cfg)
    with pytest.raises(ValueError, match="not a loopback address"):
        server.start()
    assert server.bound_endpoint is None


def test_key_files(tmp_path, capsys):
    secret = tmp_path / "keys" / "server.key_secret"
    pair = write_key_pair(secret)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert public_key_path(secret) == tmp_path / "keys" / "server.key"
    assert read_key_pair(secret) == pair and read_public_key(public_key_path(secret)) == pair.public
    assert zmq.auth.load_certificate(secret) == (pair.public.encode(), pair.secret.encode())
    assert pair.secret not in public_key_path(secret).read_text() and pair.secret not in repr(pair)
    with pytest.raises(FileExistsError):
        write_key_pair(secret)  # never overwritten
    os.chmod(secret, 0o644)
    with pytest.raises(ValueError, match="readable by others.*chmod 600"):
        read_key_pair(secret)
    with pytest.raises(ValueError, match="no secret-key"):
        os.chmod(public_key_path(secret), 0o600)
        read_key_pair(public_key_path(secret))

    other = write_key_pair(tmp_path / "keys" / "client")  # not .key_secret: public is client.pub
    listing = tmp_path / "clients.txt"
    listing.write_text(f"# allowed clients\n{pair.public}  # the server's, why not\n\n  {other.public}\n")
    assert read_client_keys(listing) == [pair.public, other.public]
    assert sorted(read_client_keys(tmp_path / "keys")) == sorted([pair.public, other.public])
    listing.write_text(f"{pair.public}\nnot-a-key\n")
    with pytest.raises(ValueError, match=r"clients\.txt:2: a CURVE key is 40"):
        read_client_keys(listing)
    with pytest.raises(ValueError, match="no such file"):
        read_client_keys(tmp_path / "nope")

    assert main(["keygen", str(tmp_path / "cli.key_secret")]) == 0
    printed = capsys.readouterr().out
    made = read_key_pair(tmp_path / "cli.key_secret")
    assert made.public in printed and made.secret not in printed
    assert main(["public", str(tmp_path / "cli.key")]) == 0 and capsys.readouterr().out.strip() == made.public
    assert main(["keygen", str(tmp_path / "cli.key_secret")]) == 1  # exists
    for bad in ("~" * 40, "#" * 40, made.public[:-1]):
        with pytest.raises(ValueError, match="server_public"):
            CurveKeys(bad, made.public, made.secret)


def test_non_loopback_endpoint_without_curve_refuses_to_start(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "specsched.daemon",
        "model=tiny",
        "log=none",
        "daemon.endpoint=tcp://0.0.0.0:5599",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "not a loopback address: binding it requires CURVE" in r.stderr, r.stderr
    assert "specsched daemon listening" not in r.stderr + r.stdout


@pytest.mark.slow
def test_curve_daemon_serves_listed_clients_only_and_never_logs_keys(start_cli_daemon, tmp_path):
    client = write_key_pair(tmp_path / "client.key_secret")
    stranger = KeyPair.generate()
    (tmp_path / "clients").write_text(f"# allowed\n{client.public}\n")
    server_secret = tmp_path / "server" / "server.key_secret"  # generated by the daemon
    d = start_cli_daemon(
        "daemon.curve=true",
        f"daemon.curve_key_file={server_secret}",
        f"daemon.curve_clients_file={tmp_path / 'clients'}",
        f"log.path={tmp_path / 'log.sqlite'}",
        curve_client=client,
    )
    assert stat.S_IMODE(server_secret.stat().st_mode) == 0o600
    server = read_key_pair(server_secret)
    keys = d.curve
    assert keys == CurveKeys.load(public_key_path(server_secret), tmp_path / "client.key_secret")

    with Client(d.endpoint, timeout_s=30, curve=keys) as ok:
        assert ok.generate(prompt_ids=[1, 2, 3], max_tokens=4).usage.completion_tokens == 4
        wrong = CurveKeys(server.public, stranger.public, stranger.secret)
        for curve in (None, wrong):  # no CURVE, or a key that is not listed: the daemon never hears it
            raw = zmq.Context.instance().socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                curve.apply(raw)
            raw.setsockopt(zmq.SNDTIMEO, 1500)  # no authenticated peer: a DEALER's send may block
            raw.connect(d.endpoint)
            try:
                raw.send(msgpack.packb({"v": 1, "type": "health"}))
            except zmq.Again:
                pass  # the handshake failed before a pipe was attached: nothing reached the daemon
            else:
                assert not raw.poll(1500), "an unauthenticated client must get no answer"
            raw.close()
        # the library sees the handshake fail: a typed error at once instead of waiting out timeout_s
        with Client(d.endpoint, timeout_s=20) as plain, pytest.raises(AuthenticationFailed) as info:
            plain.generate(prompt_ids=[1, 2, 3], max_tokens=4)
        assert isinstance(info.value, ConnectionError) and info.value.code == "auth_failed"
        with Client(d.endpoint, timeout_s=20, curve=wrong) as unknown:
            with pytest.raises(AuthenticationFailed, match="not allowed"):
                unknown.health()
        stream = ok.stream(prompt_ids=[4, 5, 6], max_tokens=8)
        assert sum(len(ch.token_ids) for ch in stream) == 8  # still serving
        stats = ok.stats()
        assert stats.num_auth_denied >= 1 and stats.num_requests_done == 2
    assert d.stop() == 0

    secrets = [server.secret, client.secret, stranger.secret]
    db = sqlite3.connect(tmp_path / "log.sqlite")
    (config,) = db.execute("SELECT config FROM runs").fetchone()
    assert str(server_secret) in config  # the config is there, with the key file's path only
    texts = [config]
    for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
        cols = [c[1] for c in db.execute(f"PRAGMA table_info({table})") if c[2] in ("TEXT", "")]
        for row in db.execute(f"SELECT {', '.join(cols)} FROM {table}") if cols else []:
            texts += [v for v in row if isinstance(v, str)]
    db.close()
    raw = (tmp_path / "log.sqlite").read_bytes()
    for secret in secrets:
        assert not any(secret in t for t in texts) and secret.encode() not in raw
        assert secret not in d.output()
