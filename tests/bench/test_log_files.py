"""bench/log_files.py: a decision log as a run's bundle holds it, plain or gzipped."""

from __future__ import annotations

import gzip
import sqlite3

from specsched.bench.log_files import plain_log


def test_a_gzipped_log_is_decompressed_once_and_a_plain_one_used_as_it_is(tmp_path):
    log = tmp_path / "a.sqlite"
    db = sqlite3.connect(log)
    db.execute("create table requests (request_id text)")
    db.execute("insert into requests values ('x:1')")
    db.commit()
    db.close()
    assert plain_log(log, tmp_path / "nowhere") == log
    packed = tmp_path / "a.sqlite.gz"
    packed.write_bytes(gzip.compress(log.read_bytes()))
    into = tmp_path / "into"
    into.mkdir()
    got = plain_log(packed, into)
    assert got == into / "a.sqlite" and got.read_bytes() == log.read_bytes()
    got.write_bytes(b"kept")  # a copy already there is used as it is
    assert plain_log(packed, into).read_bytes() == b"kept"
