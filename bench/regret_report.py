"""The tables of ``bench=regret`` (:mod:`specsched.bench.regret` measures them): per cell goodput against
the oracle and non-speculative, every config's row with its step phases, goodput against its variants,
and the cost models' held-out error."""

from __future__ import annotations

from specsched.bench.markdown import fmt, table
from specsched.bench.regret_cells import NON_SPEC


def _ratio(r: dict | None) -> str:
    return "–" if r is None else f"{r['median']:.3f} [{r['min']:.3f}–{r['max']:.3f}]"


def _by_batch(res: dict) -> str:
    by = res.get("min_steps_by_batch") or {}
    return f" (at batch {', '.join(f'{b}: >= {n}' for b, n in sorted(by.items()))})" if by else ""


def _shape(res: dict) -> str:
    if res.get("refill"):
        firsts = ", the first requests cut short to finish spread over one request" * bool(res.get("stagger"))
        shape = f"refilled windows (the batch kept full, a finished request replaced at once{firsts})"
    else:
        shape = "closed groups (each window whole passes of groups of the batch size)"
    hold = res.get("profile_hold") or 1
    return shape + (f"; the warm-up profile held each (k, scorer) {hold} steps" if hold > 1 else "")


def regret_markdown(res: dict) -> str:
    """The cell table, every config's table and the held-out cost-model error table."""
    cells = res["cells"]
    head = ["suite", "model", "proposer", "batch", "oracle (best config but goodput)", "oracle tok/s",
            "goodput tok/s", "goodput / oracle", "non-spec tok/s", "goodput / non-spec",
            "goodput decide ms p99", "min steps"]  # fmt: skip
    rows, detail, errors, variants = [], [], [], []
    for c in cells:
        cf, good = c["configs"], c.get("goodput")
        oracle = c.get("oracle")
        rows.append([c["suite"], c["model"], c["proposer"], c["batch"], oracle or "–",
                     fmt(cf[oracle]["tokens_per_s"], 1) if oracle else "–",
                     fmt(cf[good]["tokens_per_s"], 1) if good else "–", _ratio(c.get("vs_oracle")),
                     fmt(cf.get(NON_SPEC, {}).get("tokens_per_s"), 1), _ratio(c.get("vs_non_spec")),
                     fmt(c.get("decide_ms_p99"), 3), min(v["min_steps"] for v in cf.values())])  # fmt: skip
        for label, v in cf.items():
            spread = f"{fmt(v['min'], 1)}–{fmt(v['max'], 1)}"
            ms = v.get("step_ms") or {}
            phases = " / ".join(fmt(ms.get(k), 3) for k in ("step", "propose", "score"))
            drafts = " / ".join(
                fmt(ms.get(k), 3) for k in ("propose_host", "propose_fresh", "propose_carried")
            )
            detail.append([c["proposer"], c["batch"], label, fmt(v["tokens_per_s"], 1), spread,
                           fmt(v["mean_k"]), v["min_steps"], v.get("num_compiles", "–"),
                           v.get("num_full_gc", "–"), phases, drafts,
                           fmt(v.get("young_gc_per_step"), 2)])  # fmt: skip
        for variant, r in (c.get("vs_variants") or {}).items():
            variants.append(f"- {c['proposer']}, batch {c['batch']}: {good} / {variant} {_ratio(r)}")
        for e in c["cost_error"]:
            live = e.get("live_median")
            errors.append([c["proposer"], e["scorer"], e["batch_size"], e["num_fit"], e["num_held_out"],
                           fmt(100 * e["median"], 1), fmt(100 * e["p90"], 1),
                           "yes" if e["median"] <= 0.05 else "**no**",
                           fmt(None if live is None else 100 * live, 1)])  # fmt: skip
    if variants:
        variants = ["Goodput against its variants, per repeat: median [min–max]", "", *variants, ""]
    big = [c["decide_ms_p99"] for c in cells if c["batch"] == 64 and c.get("decide_ms_p99") is not None]
    error_head = [
        "proposer",
        "scorer",
        "batch",
        "fitted",
        "held out",
        "median abs. error %",
        "p90 %",
        "<= 5%",
        "predicted before learnt (live) median %",
    ]
    parts = [
        f"### Regret (issue 13): {res['repeats']} interleaved repeats of >= {res['min_steps']} decode "
        f"steps per config{_by_batch(res)}, {_shape(res)}; ratios per repeat: median [min–max]", "",
        table(head, rows), "",
        f"goodput decide p99 at batch 64: {fmt(max(big), 3) + ' ms' if big else '– (no batch-64 cell)'}", "",
        *variants,
        "### Regret: every config (tok/s median over repeats, min–max; step / propose / score ms: the "
        "median of each window's decode records, median over repeats; young GCs: the collector's "
        "generation 0 and 1 passes a decode record; propose host / fresh / carried: its Python ms, "
        "its ms on steps that ran a plan decided ahead for them and on steps that ran a held plan "
        "again)", "",
        table(["proposer", "batch", "config", "tok/s", "min–max", "mean k", "min steps",
               "compiles in windows", "full GCs in windows", "step / propose / score ms",
               "propose host / fresh / carried ms", "young GCs / step"], detail), "",
        "### Cost-model held-out error (score ms; fitted on the first half of each scorer × batch's "
        "timed steps, scored on the rest)", "", table(error_head, errors),
    ]  # fmt: skip
    parts += [f"- **regret {name} failed**: `{err}`" for name, err in res.get("errors", {}).items()]
    return "\n".join(parts) + "\n"
