"""bench/serve_requests.py: every timed request as its client saw it, the passes under two dealing
rules, and the clients' round trips between requests."""

from __future__ import annotations

import gzip
import json
import sqlite3

import pytest

from specsched.bench import serve_requests as sr
from specsched.bench.serve_results import PassResult, RequestResult, split_interleaved, summarize_many


def loop(opens_at: float, reqs: list[tuple], window_s: float = 4.0) -> PassResult:
    """A timed loop of 2 clients; each request (client, seq, sent, latency, tokens) gets its tokens in
    one chunk at its end."""
    out = [
        RequestResult(0, [1] * n, ttft_s=lat, latency_s=lat, sent_at=sent, chunk_at=[sent + lat],
                      chunk_tokens=[n], client=c, seq=seq)
        for c, seq, sent, lat, n in reqs
    ]  # fmt: skip
    return PassResult(opens_at + window_s + 1, out, window_s=window_s, ramp_s=1.0, opens_at=opens_at,
                      closes_at=opens_at + window_s, concurrency=2)  # fmt: skip


# two loops alike: client 0's requests 0, 1, 2, client 1's 0, 1; window [10, 14) and [30, 34)
SPEC = [(0, 0, 9.5, 1.0, 10), (0, 1, 10.6, 1.0, 20), (0, 2, 11.8, 1.0, 30),
        (1, 0, 9.0, 2.0, 40), (1, 1, 11.2, 2.0, 50)]  # fmt: skip
LOOPS = [loop(10.0, SPEC), loop(30.0, [(c, s, t + 20.0, lat, n) for c, s, t, lat, n in SPEC])]


def rows() -> list[dict]:
    return sr.request_rows("goodput", 2, LOOPS, [0, 1], period=1)


def test_rows_are_in_each_loop_s_window_time():
    got = rows()
    assert len(got) == 10 and {r["round"] for r in got} == {0, 1}
    assert [r["replica"] for r in got] == [0] * 5 + [1] * 5
    first = got[0]  # sent 0.5 s before the window, its tokens arrive 0.5 s into it
    assert first["sent"] == pytest.approx(-0.5) and first["end"] == pytest.approx(0.5)
    assert first["in_window"] == 10 and first["busy"] == pytest.approx(0.5)
    assert got[5]["sent"] == pytest.approx(-0.5)  # the second loop's times are its own window's
    # an untimed loop (no window) or a failed one adds nothing
    assert sr.request_rows("x", 2, [PassResult(1.0, LOOPS[0].requests)], [0], 1) == []


def test_pass_rates_by_request_number_are_the_bench_s_own():
    """Dealt by ``seq`` the passes' tok/s equal what the run's table computes (summarize_many over
    split_interleaved's parts), so the file can stand in for the table."""
    parts = [split_interleaved(lp, 2, 1, 1.0)[0] for lp in LOOPS]
    want = [summarize_many([p[i] for p in parts])["tokens_per_s"] for i in range(2)]
    assert sr.pass_rates(rows(), "seq") == pytest.approx(want)


def test_dealing_by_request_number_plus_round_swaps_the_passes_of_odd_rounds():
    got = rows()
    by_seq = [sr.pass_of_row(r, "seq") for r in got]
    by_round = [sr.pass_of_row(r, "seq+round") for r in got]
    assert by_seq[:5] == by_round[:5] and by_round[5:] == [1 - p for p in by_seq[5:]]
    # both loops alike: by seq each pass holds the same requests twice, by seq + round the two passes
    # hold every request once each, so their tok/s are equal
    a, b = sr.pass_rates(got, "seq+round")
    assert a == pytest.approx(b)
    assert sr.spread(sr.pass_rates(got, "seq")) > 0.1 and sr.spread([a, b]) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="unknown rule 'seq\\+1'; known: seq, seq\\+round"):
        sr.pass_of_row(got[0], "seq+1")


def test_round_trips_are_a_client_s_gaps_between_consecutive_requests():
    # client 0: 10.5 -> 10.6, 11.6 -> 11.8; client 1: 11.0 -> 11.2; the same in the second loop
    assert sorted(sr.round_trips(rows())) == pytest.approx([0.1, 0.1, 0.2, 0.2, 0.2, 0.2])


def test_the_file_round_trips_and_the_report_reads_it(tmp_path, capsys):
    run = tmp_path / "run" / "bench" / "serve_logs"
    run.mkdir(parents=True)
    assert sr.write_rows(run / sr.FILE_NAME, rows()) == 10
    with gzip.open(run / sr.FILE_NAME, "rt") as f:
        assert json.loads(f.readline())["config"] == "goodput"
    assert sr.read_rows(tmp_path / "run") == rows()  # a run directory: the file found under it
    assert sr.main([str(tmp_path / "run"), "--out", str(tmp_path / "r.md")]) == 0
    shown = capsys.readouterr().out
    line = next(x for x in shown.splitlines() if x.startswith("| goodput |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:3] == ["goodput", "2", "2"]
    assert cells[5] == "200.0"  # round trip p50 ms
    assert (tmp_path / "r.md").read_text().strip() == shown.strip()
    # no file: a clear error, exit status 2
    (tmp_path / "empty").mkdir()
    assert sr.main([str(tmp_path / "empty")]) == 2
    assert "no requests.jsonl.gz under" in capsys.readouterr().err


def test_requests_pair_with_the_daemon_s_log_by_id(tmp_path, capsys):
    """Where a request's time went: its rows carry the message id and the send's wall time, a daemon's
    log its arrival, first token and finish (``<client hex>:<id>``), plain or gzipped."""
    got = rows()
    for i, r in enumerate(got):
        r["id"], r["sent_wall"] = f"m{i}", 1000.0 + 100 * i + r["sent"]
    logs = tmp_path / "logs"
    logs.mkdir()
    for name, part in (("a", got[:5]), ("b", got[5:])):
        db = sqlite3.connect(logs / f"{name}.sqlite")
        db.execute(
            "create table requests (request_id text, arrival real, first_token_time real, finish_time real)"
        )
        for r in part:  # the daemon has it 2 ms after the send, finishes 3 ms before the client's last
            # chunk, and the first chunk reaches the client 1 ms after the daemon's first token
            t0 = r["sent_wall"]
            first, finish = t0 + r["first"] - r["sent"] - 0.001, t0 + r["end"] - r["sent"] - 0.003
            row = (f"00ff:{r['id']}", t0 + 0.002, first, finish)
            db.execute("insert into requests values (?, ?, ?, ?)", row)
        db.commit()
        db.close()
    with open(logs / "b.sqlite", "rb") as f, gzip.open(logs / "b.sqlite.gz", "wb") as g:
        g.write(f.read())
    (logs / "b.sqlite").unlink()
    times = sr.daemon_times(sorted(logs.glob("*.sqlite*")))
    assert len(times) == 10 and times["m0"][0] == pytest.approx(got[0]["sent_wall"] + 0.002)
    (line,) = sr.path_rows(got, times)
    assert line[:3] == ["goodput", "2", "10"]
    # medians: a request's TTFT here is its latency (1 s for 6 of the 10), less the 3 ms on both sides
    assert [float(x) for x in line[3:]] == pytest.approx([2.0, 997.0, 1.0, 3.0], abs=0.05)
    run = tmp_path / "run"
    run.mkdir()
    sr.write_rows(run / sr.FILE_NAME, got)
    assert sr.main([str(run), "--logs", str(logs)]) == 0
    assert "| goodput | 2 | 10 | 2.0 | 997.0 | 1.0 | 3.0 |" in capsys.readouterr().out
    assert sr.main([str(run), "--logs", str(run)]) == 2  # a folder without logs: a clear error
    assert "no decision logs (*.sqlite, *.sqlite.gz) in" in capsys.readouterr().err
