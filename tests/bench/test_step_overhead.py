"""The host-overhead bench runs end to end on the tiny model (a smoke test: it wraps the engine's
private timers, so a change to their signature must break here, not in the next measurement)."""

from __future__ import annotations

import re

from specsched.bench.step_overhead import PHASES, main


def test_the_bench_prints_a_row_per_config_and_batch_with_every_phase(capsys):
    args = "--batches 1 --tokens 12 --graphs emulate --configs ngram-goodput --top 0"
    main(args.split())
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ngram + goodput | 1 |")]
    assert len(rows) == 2, out  # the per-step table and the per-phase table
    phase_cells = [float(c) for c in rows[1].strip("|").split("|")[2:]]
    assert len(phase_cells) == len(PHASES)
    by_phase = dict(zip(PHASES, phase_cells, strict=True))
    assert by_phase["score"] > 0 and by_phase["decide"] > 0, by_phase  # the engine's timers were read
    steps = int(rows[0].split("|")[3])
    assert steps > 0 and re.search(r"decode_steps=1", out)


def test_the_draft_loop_option_moves_the_self_drafts_uploads_into_its_one_replay(capsys):
    """``--draft-loop``: the self-draft's propose on the (emulated) loop graphs; its host-to-device
    copies a step go (the step-by-step path uploads each step's inputs), and it needs emulated graphs."""
    import pytest

    copies = {}
    for flag in ("", " --draft-loop"):
        main(f"--batches 2 --tokens 10 --graphs emulate --configs draft-fixed --top 0{flag}".split())
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("| self-draft + fixed k=4 mqa | 2 |"))
        copies[flag] = float(row.strip("|").split("|")[-1].split("/")[1])
        assert f"draft_loop={bool(flag)}" in out
    assert copies[""] >= 1.0 and copies[" --draft-loop"] < copies[""], copies
    with pytest.raises(SystemExit):
        main("--graphs off --draft-loop".split())


def test_the_overlap_option_indexes_in_the_scoring_window(capsys):
    """``--overlap``: the step in the CUDA order, the n-gram proposer's ``on_scoring`` timed in the
    column ``overlap``; without it (the CPU engine's order) that column stays 0."""
    overlap = {}
    for flag in ("", " --overlap"):
        main(f"--batches 4 --tokens 16 --graphs emulate --configs ngram-fixed --top 0{flag}".split())
        out = capsys.readouterr().out
        row = [line for line in out.splitlines() if line.startswith("| ngram + fixed k=4 mqa | 4 |")][1]
        cells = dict(zip(PHASES, [float(c) for c in row.strip("|").split("|")[2:]], strict=True))
        overlap[flag] = cells["overlap"]
        assert f"overlap={bool(flag)}" in out
    assert overlap[""] == 0.0 and overlap[" --overlap"] > 0.0, overlap
