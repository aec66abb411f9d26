"""Markdown of ``bench=serve`` (bench/serve.py): the daemons, one row per (config, N, pass), and the
issue's serving targets (goodput vs the best fixed row and vs non-speculative at every N; compiles;
pass-to-pass spread)."""

from __future__ import annotations

from specsched.bench.markdown import fmt, table
from specsched.bench.serve_drift import drift_note, rounds_table, threads_table
from specsched.bench.serve_host import daemon_host_table, host_note, host_table, step_mix_table
from specsched.bench.serve_plans import plan_table
from specsched.bench.serve_replicas import replica_note, replica_table
from specsched.bench.serve_round_tables import LEAD_GOAL, mean_tok_s, paired_table, slices_table
from specsched.bench.serve_shapes import shape_table

SPREAD_GOAL = 0.05  # the two passes of a row within 5%


def _ms(p50: float | None, p99: float | None) -> str:
    return f"{fmt(p50, 1)} / {fmt(p99, 1)}"


def _na(x) -> str:
    return "n/a" if x is None else str(x)


def configs_table(res: dict) -> str:
    out = []
    for c in res["configs"]:
        status = f"error: {c['error'][:200]}" if c["error"] else "ok"
        kind = c["kind"] + (f" (same output vs {c['reference']})" if c.get("reference") else "")
        out.append([c["name"], kind, f"`{' '.join(c['overrides'])}`", fmt(c["startup_s"], 1),
                    _na(c["compiles_total"]), _na(c["exit_status"]), status])  # fmt: skip
    text = table(["config", "kind", "overrides", "start-up s", "compiles after start-up (end)",
                  "exit", "status"], out)  # fmt: skip
    first = next((c for c in res["configs"] if c["startup_s"] is not None), None)
    warm = res.get("warm_start")
    if first is not None:
        line = f"Start-up of `{first['name']}`: cold (first daemon of the run) {fmt(first['startup_s'], 1)} s"
        if warm:
            line += f", warm (restarted at the end) {fmt(warm['startup_s'], 1)} s"
            line += f" ({warm['error']})" if warm["error"] else ""
        prep = res.get("weights")
        if prep and prep.get("conversion") == "built":
            line += (f"; the weights were converted before it (once, {fmt(prep['seconds'], 1)} s: "
                     "`python -m specsched.models.prepare`), so its start-up is the kernels' cold "
                     "one")  # fmt: skip
        elif prep and prep.get("conversion") == "hit":
            line += "; the converted weights were already cached"
        elif prep and prep.get("error"):
            line += f"; preparing the weights failed ({prep['error']})"
        text += "\n\n" + line + "."
    return text


def _requests(r: dict) -> str:
    """A counted pass's requests; a timed pass's requests sent inside the window."""
    inside = r.get("requests_in_window")
    return str(r["num_requests"] if inside is None else inside)


def rows_table(rows: list[dict]) -> str:
    header = ["config", "N", "pass", "tok/s", "spread vs pass 1", "TTFT ms p50 / p99", "ITL ms p50 / p99",
              "compiles", "same output", "accept.", "tok/step", "requests", "errors"]  # fmt: skip
    order = {c: i for i, c in enumerate(dict.fromkeys(r["config"] for r in rows))}
    out = []
    for r in sorted(rows, key=lambda r: (order[r["config"]], r["concurrency"], r["pass"])):
        err = str(r["num_errors"]) + (f" ({r['first_error'][:80]})" if r["first_error"] else "")
        if r.get("error"):
            err += f"; {r['error'][:80]}"
        out.append([r["config"], str(r["concurrency"]), str(r["pass"]), fmt(r["tokens_per_s"], 1),
                    _spread(r),
                    _ms(r["ttft_p50_ms"], r["ttft_p99_ms"]), _ms(r["itl_p50_ms"], r["itl_p99_ms"]),
                    _na(r["compiles"]), fmt(r["same_output"]), fmt(r["acceptance"]),
                    fmt(r["tokens_per_step"]), _requests(r), err])  # fmt: skip
    return table(header, out)


def _spread(r: dict) -> str:
    """The row's spread vs pass 1; with the raw one beside it when the spread is on the same prompt mix."""
    if r["spread"] is None:
        return "–"
    if r.get("same_mix_tok_s") is None or r.get("spread_raw") is None:
        return f"{100 * r['spread']:.1f}%"
    return f"{100 * r['spread']:.1f}% (raw {100 * r['spread_raw']:.1f}%)"


def target_rows(res: dict) -> list[dict]:
    """Issue 12's targets per N from a serve result (``configs`` and ``rows``): the default config's
    tok/s (mean over its passes) against the best fixed row's (``vs_best``: ratio − 1), the
    baseline's (``vs_base``: ratio) and any other config's (``vs_other``, issue 13), and whether the
    line is ``met`` (vs_best ≥ −3 % and vs_base ≥ 1; None when a side is missing). One dict per N,
    in order."""
    rows = res["rows"]
    kinds = {c["name"]: c["kind"] for c in res["configs"]}
    tok = mean_tok_s(rows)
    default = next((n for n, k in kinds.items() if k == "default"), None)
    base = next((n for n, k in kinds.items() if k == "baseline"), None)
    out = []
    for n in sorted({r["concurrency"] for r in rows}):
        fixed = [(tok[(c, n)], c) for c, k in kinds.items() if k == "fixed" and (c, n) in tok]
        best = max(fixed, default=None)
        # issue 13: any other config (fixed rows, the other policies), the baseline included
        other = max(((tok[(c, n)], c) for c in kinds if c != default and (c, n) in tok), default=None)
        g, b = tok.get((default, n)), tok.get((base, n))
        vs_best = g / best[0] - 1 if g and best else None
        vs_base = g / b if g and b else None
        out.append({
            "concurrency": n, "tok_s": g, "best": best, "vs_best": vs_best,
            "base_tok_s": b, "vs_base": vs_base, "other": other,
            "vs_other": g / other[0] if g and other else None,
            "met": None if vs_best is None or vs_base is None else vs_best >= -LEAD_GOAL and vs_base >= 1,
        })  # fmt: skip
    return out


def targets_table(res: dict) -> str:
    rows = res["rows"]
    targets = target_rows(res)
    default = next((c["name"] for c in res["configs"] if c["kind"] == "default"), None)
    base = next((c["name"] for c in res["configs"] if c["kind"] == "baseline"), None)
    out = []
    for t in targets:
        best, other, vs_best, met = t["best"], t["other"], t["vs_best"], t["met"]
        best_text = f"{best[1]} {fmt(best[0], 1)}" if best else "–"
        out.append([str(t["concurrency"]), fmt(t["tok_s"], 1), best_text,
                    "–" if vs_best is None else f"{100 * vs_best:+.1f}%", fmt(t["base_tok_s"], 1),
                    fmt(t["vs_base"]), "–" if met is None else ("yes" if met else "**no**"),
                    f"{other[1]} {fmt(other[0], 1)}" if other else "–", fmt(t["vs_other"], 3)])  # fmt: skip
    header = ["N", f"{default or 'default'} tok/s", "best fixed tok/s", "vs best fixed (≥ -3%)",
              f"{base or 'non-spec'} tok/s", "× non-spec (≥ 1)", "met", "best other config (issue 13)",
              "× best other (≥ 0.97)"]  # fmt: skip
    compiles = [r["compiles"] for r in rows if r["compiles"] is not None]
    spreads = [r["spread"] for r in rows if r["spread"] is not None]
    raw = [r["spread_raw"] for r in rows if r.get("spread_raw") is not None]
    is_mix = any(r.get("same_mix_tok_s") is not None for r in rows)
    same = [r["same_output"] for r in rows if r["same_output"] is not None]
    lines = [
        f"- compiles after start-up, most in one pass: {max(compiles) if compiles else 'n/a'} (goal 0)",
        f"- pass-to-pass spread of tok/s, largest{' (same prompt mix)' if is_mix else ''}: "
        f"{f'{100 * max(spreads):.1f}%' if spreads else '–'} (goal ≤ {100 * SPREAD_GOAL:.0f}%)"
        + (f"; raw (each pass's own prompts): {100 * max(raw):.1f}%" if is_mix and raw else ""),
        f"- same output as the baseline (or the config's own reference), lowest share: "
        f"{fmt(min(same)) if same else '–'}",
    ]
    return table(header, out) + "\n\n" + "\n".join(lines)


def _ramps(rows: list[dict]) -> str:
    ramps = [r["ramp_s"] for r in rows if r.get("ramp_s") is not None]
    return f"{min(ramps):.2f}–{max(ramps):.2f} s" if ramps else "–"


def _window(s: dict) -> str:
    text = _window_text(s)
    if s.get("rounds") and (s.get("replicas") or 1) > 1:
        r = s["replicas"]
        text += f"; each config served by {r} daemon processes (replicas), round r at the i-th N on "
        text += f"replica (r + i) mod {r}"
    return text


def _window_text(s: dict) -> str:
    if s.get("rounds") and s.get("rounds_per_n"):
        s = {
            **s,
            "rounds": "/".join(map(str, s["rounds_per_n"]))
            + f" (N = {'/'.join(map(str, s['concurrency']))})",
        }
    if s.get("rounds") and s.get("interleave_s"):
        window = f"{s.get('passes', 2)} × {s['duration_s']:g} s"
        return (f"every config's daemon up at once and, per N, {s['rounds']} rounds, each one loop per "
                "config in a fresh seeded order (every config measured across the same stretch of the "
                f"host's time; bench/serve_rounds.py), each loop's window {window} with its requests "
                "dealt to the passes in turn, each pass pooled over the rounds (a pass's tok/s = N × its "
                "tokens in the windows / its requests' busy time there); every round's tok/s in the "
                "rounds table")  # fmt: skip
    if s.get("rounds"):
        return (f"a {s['duration_s']:g} s window; every config's daemon up at once and, per N, {s['rounds']} "
                "rounds, each one loop per config in a fresh seeded order (pass r = round r: every config "
                "measured across the same stretch of the host's time; bench/serve_rounds.py)")  # fmt: skip
    if not s.get("interleave_s"):
        return f"a {s['duration_s']:g} s window"
    passes = s.get("passes", 2)
    return (f"one window of {passes} × {s['duration_s']:g} s per N whose requests are dealt to the passes in "
            "turn (each client's requests alternate between the passes, and each cycle of its prompts "
            "starts on the other pass: both passes see the same host drift and the same prompts; a pass's "
            f"tok/s = N × its tokens in the window / its requests' busy time in it); the loop's tok/s in "
            f"{s['interleave_s']:g} s slices is in the slices table)")  # fmt: skip


def _pass_note(s: dict, rows: list[dict] = ()) -> str:
    if s.get("duration_s"):
        floor = f", at least {s['ramp_s']:g} s" if s.get("ramp_s") else ""
        return (
            "each pass a closed loop (each client sends its next streamed request when one is done; client "
            "c of N sends prompts c, c+N, c+2N, … of the list, the same in both passes) with a staggered "
            f"start (client c's first request has max_tokens ⌈{s.get('max_tokens')}·(c+1)/N⌉, later ones "
            f"the full {s.get('max_tokens')}), a ramp until every client's first request is done "
            f"({_ramps(rows)} over the rows{floor}), then {_window(s)}. tok/s = tokens "
            "that arrived in the window / its length; TTFT, accept., tok/step and requests from the "
            "requests sent in the window, ITL from the tokens that arrived in it; requests still running "
            "at its end finish outside it"
        )
    return (f"max(N, {s.get('num_requests')}) streamed requests per pass. tok/s = output tokens / wall "
            "time of the pass")  # fmt: skip


def _step_mix(res: dict) -> list[dict]:
    return [c["step_mix"] for c in res["configs"] if c.get("step_mix")]


def serve_section(res: dict) -> str:
    s = res.get("settings", {})
    passes = _pass_note(s, res["rows"])
    note = (
        f"Daemon subprocess per config (`model.source={s.get('source')}` "
        f"{' '.join(s.get('model_overrides') or [])}), N concurrent protocol clients, "
        f"{s.get('prompts')} prompts, greedy, `max_tokens` {s.get('max_tokens')}, {passes}; "
        "TTFT = send → first chunk with tokens; ITL = gap between chunks / tokens in the chunk "
        "(one sample per token); compiles = delta of the daemon's `num_compiles_after_start` over the "
        "pass (n/a: not reported by this daemon); same output = share of the full-length requests (a "
        "timed pass's cut-short first ones left out) whose token ids equal the baseline's pass-1 output "
        "for the prompt at the same N (a config whose kind names another config: that one's first-round "
        "output); accept. = accepted / proposed."
    )
    if any(r.get("same_mix_tok_s") is not None for r in res["rows"]):
        note += (" Spread vs pass 1 on the same prompt mix: the dealt passes hold different requests, so"
                 " each pass's tok/s is recomputed for the prompts of both passes together, at the pass's"
                 " own speed per prompt (bench/serve_results.py same_mix_rates); raw = each pass's own"
                 " prompts.")  # fmt: skip
    return "\n".join([
        "### Serving benchmark (bench=serve)", "", note, "", configs_table(res), "",
        rows_table(res["rows"]), "",
        *(["Tok/s of each round's loop (every config's rounds interleaved in time):", "",
           slices_table(res["rows"], "round_tok_s", "round"), ""]
          if slices_table(res["rows"], "round_tok_s", "round") else []),
        *(["Tok/s of each slice of the interleaved loops:", "", slices_table(res["rows"]), ""]
          if slices_table(res["rows"]) else []),
        *([replica_note(), "", replicas, ""] if (replicas := replica_table(res["rows"])) else []),
        "Targets (issue 12):", "", targets_table(res), "",
        *(["The targets per round (the configs' loops of one round ran in the same seconds):", "",
           paired, ""] if (paired := paired_table(res)) else []),
        *(["Tokens and time by prompt, each policy against the first fixed row (decode steps of batch "
           "size N; a prompt's tokens per request-step in both logs, and the wall ms per step: how much of "
           "a tok/s gap is the decisions and how much the time; bench/serve_paired.py):", "",
           res["by_prompt"]]
          if res.get("by_prompt") else []),
        *([host_note(), "", host_table(res["host_phases"]), ""] if res.get("host_phases") else []),
        *([drift_note(), "", res["drift"], ""] if res.get("drift") else []),
        *([res["requests"], ""] if res.get("requests") else []),
        *(["Each round's loop (tok/s, its host ms from the log, the engine thread's nonvoluntary context "
           "switches during it, the busiest load process's core share):", "", rounds, ""]
          if (rounds := rounds_table(res["rows"])) else []),
        *(["The daemon's threads in each round's loop (CPU seconds over the loop's wall seconds; the engine, "
           "IO and log-writer threads share one interpreter lock; on CUDA the engine thread spins in its "
           "device waits, so its share says little, the IO and log threads' say what they take):", "",
           threads, ""]
          if (threads := threads_table(res["rows"])) else []),
        *(["The kernel's counters for each daemon at the end of its passes (daemon/host_stats.py; a daemon "
           "slower than another on the same code path may show why):", "", hosts, ""]
          if (hosts := daemon_host_table(res["configs"])) else []),
        *(["Where each daemon's time went (decision logs, every pass and N; step wall ms + the loop's "
           "time before it):", "", step_mix_table(mix), ""] if (mix := _step_mix(res)) else []),
        *(["The same step shape in each daemon (decode steps of batch size N at the shapes most configs "
           "share; medians of the scoring forward's CUDA-event ms and the step's wall ms: a config slower "
           "at the same shape pays host time its choices do not explain; bench/serve_shapes.py):", "",
           shapes, ""] if (shapes := shape_table([r for c in res["configs"] for r in c.get("shapes") or []]))
          else []),
        *(["What a decide costs the steps (decode steps of batch size N by where their plan came from: "
           "carried from an earlier step, carried while the step's scoring window held a decide ahead "
           "(deciding), decided ahead during the last step (ahead), decided on the step; each kind's "
           "share and median step ms / spill ms (between + first event + score: where the IO and log "
           "threads' work lands when a decide ahead filled the device wait) / post-launch ms (overlap + "
           "verify); a decide ahead's cost: the deciding steps' post-launch and the ahead steps' spill "
           "beyond the carried steps'; bench/serve_plans.py):", "", plans, ""]
          if (plans := plan_table([r for c in res["configs"] for r in c.get("plans") or []])) else []),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """``python -m specsched.bench.serve_report RESULTS.json``: the serving section of a results file:
    the bench's ``results.json`` (its ``serve`` part) or the ``serve_logs/partial.json`` a run cut at
    its time limit leaves (the N done so far; same output is not checked there)."""
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("results", type=Path)
    args = ap.parse_args(argv)
    res = json.loads(args.results.read_text())
    res = res.get("serve", res)
    if not isinstance(res, dict) or "rows" not in res or "configs" not in res:
        raise SystemExit(f"{args.results}: no serving results (rows and configs) in it")
    if res.get("is_partial"):
        print("Partial results (the run stopped before its last N; same output not checked):\n")
    print(serve_section(res))


if __name__ == "__main__":
    main()
