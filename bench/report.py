"""Markdown tables of a benchmark run, the issue's targets checked against them, and the append to
docs/benchmarks.md (date, device, exact command)."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from pathlib import Path

from specsched.bench.markdown import fmt, table

SCORER_LABELS = {
    "batch_expansion": "batch expansion",
    "mqa": "MQA",
    "mqa_graph": "MQA graph",
    "mqa piecewise": "MQA piecewise",
}


def scorer_table(res: dict) -> str:
    """One row per (batch, k, context): each scorer's median ms (× floor) and its path."""
    names = list(dict.fromkeys(r["scorer"] for r in res["rows"]))
    cells: dict[tuple, dict] = defaultdict(dict)
    for r in res["rows"]:
        cells[(r["batch"], r["k"], r["context"])][r["scorer"]] = r
    header = ["batch", "k", "context", *[f"{SCORER_LABELS.get(n, n)} ms (×floor)" for n in names]]
    if {"batch_expansion", "mqa_graph"} <= set(names):
        header.append("BE / MQA graph")
    out = []
    for key in sorted(cells, key=lambda s: (s[2], s[0], s[1])):
        row = [str(v) for v in key]
        for n in names:
            r = cells[key].get(n)
            if r is None:
                row.append("–")
            elif r["error"]:
                row.append(f"error: {r['error'][:60]}")
            else:
                path = "" if r["path"] in ("graph", "eager", "piecewise") else f" [{r['path']}]"
                row.append(f"{fmt(r['ms'], 3)} ({fmt(r['vs_floor'])}×){path}")
        if len(header) > len(row):
            be, mq = cells[key].get("batch_expansion"), cells[key].get("mqa_graph")
            row.append(fmt(be["ms"] / mq["ms"]) if be and mq and mq["ms"] else "–")
        out.append(row)
    fused = res.get("fused_linear")
    fused = (
        f", fused small-M linear layers ({fused})"
        if isinstance(fused, str)
        else ", fused small-M linear layers"
        if fused
        else ""
    )
    fused += ", programmatic dependent launch" if res.get("pdl") else ""
    note = (
        f"{res['model']} ({res['dtype']}, random weights{fused}) on {res['device']}: floor = "
        f"{res['weight_bytes'] / 1e9:.2f} GB streamed weights / {res['copy_bandwidth'] / 1e12:.2f} TB/s "
        f"measured copy bandwidth (read + write) = **{res['floor_ms']:.3f} ms**. Paths: graph = replay, "
        f"eager = no graphs; a bracket names an eager fallback."
    )
    for g in res.get("graphs", []):
        note += (
            f" Graphs ({g['name']}): {g['num_graphs']} captured in {g['capture_s']} s, "
            f"{g['graph_memory_mib']} MiB; {g['num_eager_fallbacks']} eager fallbacks "
            f"{g.get('fallback_reasons') or ''}."
        )
    parts = [note, "", table(header, out)]
    if res.get("draft_rows"):
        drows = [[d["model"], str(d["batch"]), fmt(d["graph_ms"], 3), fmt(d["eager_ms"], 3)]
                 for d in res["draft_rows"]]  # fmt: skip
        parts += ["", "Draft model, one single-token step:", "",
                  table(["draft", "batch", "graph ms", "eager ms"], drows)]  # fmt: skip
    return "\n".join(parts)


def e2e_table(rows: list[dict]) -> str:
    header = ["suite", "model", "proposer", "batch", "config", "tok/s", "ms/token", "× non-spec",
              "accept.", "mean k", "scorer steps", "step ms: propose/score/verify/total", "same output",
              "fallbacks", "note"]  # fmt: skip
    out = []
    for r in rows:
        steps = ", ".join(f"{SCORER_LABELS.get(s, s)} {n}" for s, n in (r.get("scorer_steps") or {}).items())
        note = f"error: {r['error']}" if r.get("error") else r.get("note", "")
        phases = r.get("step_ms") or {}
        step_ms = "/".join(fmt(phases.get(p), 2) for p in ("propose", "score", "verify", "total"))
        out.append([
            r["suite"], r["model"], r["proposer"], str(r["batch"]), r["config"], fmt(r["tokens_per_s"], 1),
            fmt(r["ms_per_token"]), fmt(r.get("speedup")), fmt(r.get("measured_acceptance")),
            fmt(r.get("mean_k")), steps, step_ms if phases else "–", fmt(r.get("same_output")),
            str(r.get("graph_fallbacks", 0)), note,
        ])  # fmt: skip
    return table(header, out)


def peers_table(rows: list[dict], e2e_rows: list[dict]) -> str:
    out = [[r["method"], fmt(r["tokens_per_s"], 1), fmt(r["ms_per_token"]), str(r["num_tokens"]),
            f"error: {r['error']}" if r["error"] else ""] for r in rows]  # fmt: skip
    best = best_row([r for r in e2e_rows if r["suite"] == "real" and r["batch"] == 1])
    if best is not None:
        label = f"specsched: {best['proposer']}, {best['config']} (best, batch 1)"
        out.append([label, fmt(best["tokens_per_s"], 1), fmt(best["ms_per_token"]), str(best["num_tokens"]),
                    ""])  # fmt: skip
    return table(["method", "tok/s", "ms/token", "tokens", "note"], out)


def best_row(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if not r.get("error") and r["tokens_per_s"] == r["tokens_per_s"]]
    return max(ok, key=lambda r: r["tokens_per_s"], default=None)


def goodput_checks(e2e: list[dict]) -> tuple[float | None, float | None]:
    """(largest relative lead of any config over goodput, worst goodput / non-speculative), over
    the groups (suite, proposer, batch) that ran goodput."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in e2e:
        groups[(r["suite"], r["proposer"], r["batch"])].append(r)
    leads, ratios = [], []
    for (suite, _, batch), rs in groups.items():
        good = [r for r in rs if r["config"].startswith("policy goodput") and not r.get("error")]
        if not good:
            continue
        best = best_row(rs)
        leads.append(best["tokens_per_s"] / good[0]["tokens_per_s"] - 1)
        bases = [r for r in groups.get((suite, "none", batch), []) if not r.get("error")]
        if bases:
            ratios.append(good[0]["tokens_per_s"] / bases[0]["tokens_per_s"])
    return max(leads, default=None), min(ratios, default=None)


def targets_table(results: dict) -> str:
    """The issue's targets, measured (– when the run did not cover the shape)."""
    checks: list[tuple[str, float | None, str, bool | None]] = []
    sc = results.get("scorers") or {}
    by = {(r["batch"], r["k"], r["context"], r["scorer"]): r for r in sc.get("rows", []) if not r["error"]}

    def ratio(b, k, c, s):
        r = by.get((b, k, c, s))
        return r["vs_floor"] if r else None

    def add(name: str, value: float | None, goal: str, ok) -> None:
        checks.append((name, value, goal, None if value is None else ok(value)))

    ctx1 = 550 if any(key[2] == 550 for key in by) else min((key[2] for key in by), default=None)
    shape = f"batch 1, k 3, ctx {ctx1}"
    add(f"batch expansion (graph), {shape}: × floor", ratio(1, 3, ctx1, "batch_expansion"), "≤ 1.25",
        lambda v: v <= 1.25)  # fmt: skip
    add(f"MQA eager, {shape}: × floor", ratio(1, 3, ctx1, "mqa"), "≤ 2", lambda v: v <= 2)
    add(f"MQA graph, {shape}: × floor", ratio(1, 3, ctx1, "mqa_graph"), "≤ 1.25", lambda v: v <= 1.25)
    be = by.get((64, 3, 2048, "batch_expansion"))
    mqa_ms = min((by[key]["ms"] for key in by if key[:3] == (64, 3, 2048) and key[3] != "batch_expansion"),
                 default=None)  # fmt: skip
    add("batch 64, k 3, ctx 2048: BE ms / best MQA ms", be["ms"] / mqa_ms if be and mqa_ms else None, "≥ 1.4",
        lambda v: v >= 1.4)  # fmt: skip
    d1 = [d for d in sc.get("draft_rows", []) if d["batch"] == 1]
    add("draft step (graph), batch 1: ms per proposed token", d1[0]["graph_ms"] if d1 else None, "≤ 0.5",
        lambda v: v <= 0.5)  # fmt: skip
    e2e = results.get("e2e", []) + results.get("real", [])
    lead, ratio_base = goodput_checks(e2e)
    add("e2e: largest lead of any config over goodput", lead, "≤ 0.03", lambda v: v <= 0.03)
    add("e2e: goodput / non-speculative, worst case", ratio_base, "≥ 1", lambda v: v >= 1)
    best1 = best_row([r for r in results.get("real", []) if r["batch"] == 1])
    add("real model, batch 1: best tok/s", best1 and best1["tokens_per_s"], "≥ 600", lambda v: v >= 600)
    rows = [[n, fmt(v, 3), g, "–" if ok is None else ("yes" if ok else "**no**")] for n, v, g, ok in checks]
    return table(["target", "measured", "goal", "met"], rows)


def render(results: dict) -> str:
    """All tables of a run as one markdown section."""
    parts = [f"## specsched-bench, {results['date']}, {results['device']}", "",
             f"Command: `{results['command']}`", ""]  # fmt: skip
    if results.get("scorers"):
        title = "### Scorer micro-benchmark (ms per scoring step, median)"
        parts += [title, "", scorer_table(results["scorers"]), ""]
    e2e = results.get("e2e", []) + results.get("real", [])
    if e2e:
        title = "### End-to-end (greedy; tokens/s over the timed generate; synthetic rows are labelled)"
        parts += [title, "", e2e_table(e2e), ""]
    if results.get("peers"):
        parts += ["### Peers (batch 1, same prompts)", "", peers_table(results["peers"], e2e), ""]
    if results.get("serve"):
        from specsched.bench.serve_report import serve_section

        parts += [serve_section(results["serve"])]
    if any(results.get(part) for part in ("scorers", "e2e", "real")):  # not for a serving-only run
        parts += ["### Targets (issue 5)", "", targets_table(results), ""]
    for name, err in results.get("errors", {}).items():
        parts += [f"- **{name} failed**: `{err}`"]
    return "\n".join(parts).rstrip() + "\n"


def now() -> str:
    return dt.datetime.now().strftime("%Y-%m-%d %H:%M")


def append_markdown(text: str, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if not p.exists():
        p.write_text("# Benchmarks\n\nEach section: one `specsched-bench` run, with its command.\n\n")
    with p.open("a") as f:
        f.write("\n" + text)
    return p
