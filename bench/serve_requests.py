"""Every request a rounds run of ``bench=serve`` timed, as its clients saw it, and what it says.

A serve run's table pools each config's requests into passes; what the passes do not keep is which
request went where, when, and what happened between a client's requests. On an H100 (2026-12-08
00:59, ``serve_h200_verdict``) goodput's two passes at N = 64 differed by 8.7 % where the same loops
rebuilt from the daemons' decision logs put them 1.5 % apart, and the daemons' logs had a client's
next request arrive 43-109 ms (median per loop) after its last one finished there, against 0.09-0.14 s
for a whole request. Both live in what only the clients see, so a rounds run now writes it:
``<out_dir>/serve_logs/requests.jsonl.gz``, one JSON object per request (:func:`request_rows`), times
in seconds from its loop's window opening.

``python -m specsched.bench.serve_requests RUN_DIR [--logs DIR] [--out FILE]`` (RUN_DIR: an unpacked
run, or the file) prints per config and N: the passes' tok/s as the run dealt them (request number ``seq``,
bench/serve_results.py ``pass_of``) and dealt by ``seq`` + round (each loop's requests at the window's
edges land in the other pass in the next loop), with their spreads; and a client's round trip between
two requests (its last chunk of one → its send of the next), median and p90, beside the median
request's busy time. A pass's tok/s is the run's own: N × its tokens in the windows / its requests'
busy seconds there (:func:`pass_rates` equals ``summarize_many`` on the same requests). With
``--logs`` (the run's decision logs; in a run's own report when it logged), each request is paired with
the daemon's record of it by id, and the time between send and last chunk is split into the send path,
the daemon's TTFT, and the two ways back (:func:`path_rows`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sqlite3
import statistics
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from specsched.bench.log_files import plain_log
from specsched.bench.loopback import pct
from specsched.bench.markdown import emit, fmt, table
from specsched.bench.serve_results import PassResult, pass_of

FILE_NAME = "requests.jsonl.gz"
RULES = ("seq", "seq+round")  # how requests are dealt to passes: the run's rule, and rotated by round


def request_rows(
    config: str, concurrency: int, loops: Sequence[PassResult], replicas: Sequence[int], period: int
) -> list[dict]:
    """One row per request of ``config``'s timed ``loops`` at ``concurrency`` (loop r on replica
    ``replicas[r]``, 0-based; ``period``: the clients' prompt cycle, bench/serve_clients.py
    ``cycle_length``). Times are seconds from the loop's window opening: ``sent``, ``first`` (first
    chunk with tokens), ``end`` (last chunk); ``tokens`` all it got, ``in_window`` those that arrived in
    the window, ``busy`` its seconds in it. Untimed or failed loops have no rows."""
    out = []
    for r, loop in enumerate(loops):
        if not loop.timed or loop.error:
            continue
        t0, t1 = loop.opens_at, loop.closes_at
        for q in loop.requests:
            out.append({
                "config": config, "n": concurrency, "round": r,
                "replica": replicas[r] if r < len(replicas) else 0,
                "client": q.client, "seq": q.seq, "prompt": q.prompt_index, "period": period,
                "sent": q.sent_at - t0, "first": None if q.ttft_s is None else q.sent_at + q.ttft_s - t0,
                "end": q.sent_at + q.latency_s - t0, "window": t1 - t0,
                "tokens": len(q.token_ids), "in_window": q.tokens_in([(t0, t1)]), "busy": q.busy_in(t0, t1),
                "is_staggered": q.staggered, "is_error": q.error is not None,
                "id": q.request_id, "sent_wall": q.sent_wall,
            })  # fmt: skip
    return out


def write_rows(path: Path, rows: Iterable[dict]) -> int:
    """``rows`` as gzipped JSON lines at ``path``; returns how many."""
    num = 0
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
            num += 1
    return num


def read_rows(path: Path) -> list[dict]:
    """The rows :func:`write_rows` wrote (``path``: the file, or a run directory holding one)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.rglob(FILE_NAME))
        if not found:
            raise FileNotFoundError(f"no {FILE_NAME} under {path} (runs before 2026-12-08 wrote none)")
        path = found[0]
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def pass_of_row(row: dict, rule: str, passes: int = 2) -> int:
    """The pass (0-based) of a request under ``rule`` (:data:`RULES`)."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known: {', '.join(RULES)}")
    seq = row["seq"] + (row["round"] if rule == "seq+round" else 0)
    return pass_of(seq, row["period"], passes)


def pass_rates(rows: Sequence[dict], rule: str, passes: int = 2) -> list[float | None]:
    """Each pass's tok/s over ``rows`` (one config and N): N × tokens in the windows / busy seconds."""
    tokens, busy = [0] * passes, [0.0] * passes
    for row in rows:
        p = pass_of_row(row, rule, passes)
        tokens[p] += row["in_window"]
        busy[p] += row["busy"]
    n = rows[0]["n"] if rows else 0
    return [n * t / b if b > 0 else None for t, b in zip(tokens, busy, strict=True)]


def round_trips(rows: Sequence[dict]) -> list[float]:
    """A client's seconds from the end of one request to the send of its next, in every loop."""
    by: dict[tuple, list[dict]] = {}
    for row in rows:
        by.setdefault((row["round"], row["replica"], row["client"]), []).append(row)
    out = []
    for mine in by.values():
        mine.sort(key=lambda row: row["seq"])
        out += [b["sent"] - a["end"] for a, b in zip(mine, mine[1:]) if b["seq"] == a["seq"] + 1]
    return out


def spread(rates: Sequence[float | None]) -> float | None:
    """max / min − 1 of the passes' tok/s (None if a pass has none)."""
    if not rates or any(r is None for r in rates) or min(rates) <= 0:
        return None
    return max(rates) / min(rates) - 1


def summary_rows(rows: Sequence[dict]) -> list[list[str]]:
    """The report's table: per config and N, the passes under each rule and the clients' round trips."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        if not row["is_error"]:
            groups.setdefault((row["config"], row["n"]), []).append(row)
    out = []
    for (config, n), mine in groups.items():
        cells = [config, str(n), str(len({r["round"] for r in mine}))]
        for rule in RULES:
            rates = pass_rates(mine, rule)
            s = spread(rates)
            note = f" ({s * 100:.1f} %)" if s is not None else ""
            cells.append(" / ".join(fmt(r, 0) for r in rates) + note)
        trips = round_trips(mine)
        busy = [r["end"] - r["sent"] for r in mine if not r["is_staggered"]]
        cells += [
            fmt(statistics.median(trips) * 1e3, 1) if trips else "–",
            fmt(pct(trips, 0.9) * 1e3, 1) if trips else "–",
            fmt(statistics.median(busy) * 1e3, 1) if busy else "–",
        ]
        out.append(cells)
    return out


def daemon_times(paths: Iterable[Path]) -> dict[str, tuple[float, float | None, float | None]]:
    """Message id → (arrival, first token, finish) of every request in the decision logs ``paths``
    (SQLite files, or gzipped ones as a run's bundle holds them); the daemon logs ``<client hex>:<id>``
    (daemon/admission.py ``request_key``), its clock ``time.time()`` as the rows' ``sent_wall``."""
    out: dict[str, tuple[float, float | None, float | None]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            db = sqlite3.connect(f"file:{plain_log(path, Path(tmp))}?mode=ro", uri=True)
            try:
                found = db.execute("select request_id, arrival, first_token_time, finish_time from requests")
                for rid, arrival, first, finish in found:
                    out[rid.split(":", 1)[-1]] = (arrival, first, finish)
            finally:
                db.close()
    return out


def path_rows(rows: Sequence[dict], times: dict[str, tuple]) -> list[list[str]]:
    """Per config and N, where a request's time went between the client and the daemon (medians, ms):
    the send until the daemon's IO thread had it, the daemon's TTFT, the first token until the client
    had it, the daemon's finish until the client's last chunk."""
    groups: dict[tuple[str, int], list[list[float]]] = {}
    for row in rows:
        found = times.get(row.get("id") or "")
        if row["is_error"] or found is None or None in found or row["first"] is None:
            continue
        arrival, first, finish = found
        sent = row["sent_wall"]
        got_first, got_last = sent + row["first"] - row["sent"], sent + row["end"] - row["sent"]
        groups.setdefault((row["config"], row["n"]), []).append(
            [arrival - sent, first - arrival, got_first - first, got_last - finish]
        )
    return [
        [
            config,
            str(n),
            str(len(mine)),
            *(fmt(statistics.median(x[i] for x in mine) * 1e3, 1) for i in range(4)),
        ]
        for (config, n), mine in groups.items()
    ]


PATH_HEADER = ["config", "N", "requests paired", "send → daemon ms", "daemon TTFT ms",
               "first token → client ms", "finish → last chunk ms"]  # fmt: skip
HEADER = ["config", "N", "rounds", "passes by seq: tok/s (spread)", "by seq + round", "round trip ms p50",
          "p90", "request ms p50"]  # fmt: skip


def report(rows: Sequence[dict], times: dict[str, tuple] | None = None) -> str:
    """The summary table and, with the daemons' request times (:func:`daemon_times`), the paths one."""
    text = (
        "Each request as its client saw it (bench/serve_requests.py): the passes' tok/s dealt by request "
        "number (the run's) and by request number + round, and a client's round trip between requests "
        "(last chunk → next send) beside a full request's time.\n\n" + table(HEADER, summary_rows(rows))
    )
    paired = path_rows(rows, times) if times else []
    if paired:
        text += (
            "\n\nWhere a request's time went between the client and the daemon (medians; the daemon's "
            "decision log paired by request id, one clock):\n\n" + table(PATH_HEADER, paired)
        )
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m specsched.bench.serve_requests", description=__doc__.split("\n")[0]
    )
    ap.add_argument("run", help=f"a run directory holding {FILE_NAME}, or the file")
    ap.add_argument("--logs", help="a folder of the run's decision logs (*.sqlite[.gz]): where the time went")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args(argv)
    try:
        logs = sorted(Path(args.logs).glob("*.sqlite*")) if args.logs else []
        if args.logs and not logs:
            raise FileNotFoundError(f"no decision logs (*.sqlite, *.sqlite.gz) in {args.logs}")
        text = report(read_rows(Path(args.run)), daemon_times(logs) if logs else None)
    except (FileNotFoundError, ValueError) as e:
        print(f"serve_requests: {e}", file=sys.stderr)
        return 2
    emit(text + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
