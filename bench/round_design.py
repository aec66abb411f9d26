"""The order of the configs' loops in each round of ``bench=serve``'s rounds mode (bench/serve_rounds.py).

The rounds run back to back, so the loops form one sequence in time. What an order must balance:

- **place**: a host that drifts over a round (or slows for a few seconds) favours one place in it;
  each config should take each place equally often;
- **predecessor**: a loop may pay for the one before it (the last daemon's log writer flushing its
  backlog, the GPU's clocks after a heavier load): each config should follow each other config equally
  often (a carry-over balanced, Williams-style design). A rotation of one order (a cyclic Latin square)
  balances the places but has each config follow the same one in every round;
- **no config twice in a row** across a round's end (a drift of a few seconds would then hit two of
  its loops: on an H100 on 2026-12-07, 19:12, goodput's two daemons ran rounds 3 and 4 at N = 4 back
  to back inside the ~8 s where every daemon's host phases ran 10-25 % slower).

:func:`round_orders` searches the rounds' orders with a beam (``BEAM`` partial designs kept, each
extended by every candidate order: every permutation for up to ``EXHAUSTIVE_UP_TO`` configs, else
``NUM_SAMPLES`` seeded shuffles), never starting a round with the config that ended the one before,
and keeps the design whose place and neighbour counts have the least sum of squares (the most even).
Ties go to the first candidate in a seeded shuffle, so each (seed, N) has its own, reproducible
design. Three configs over six rounds: each config takes each place twice, each ordered pair of
configs are neighbours 2-3 times (17 neighbourships over 6 pairs).
"""

from __future__ import annotations

import itertools
import random

__all__ = ["EXHAUSTIVE_UP_TO", "NUM_SAMPLES", "round_orders"]

EXHAUSTIVE_UP_TO = 6  # configs: every permutation is a candidate (720 at most)
NUM_SAMPLES = 200  # candidates per round beyond that: seeded shuffles
BEAM = 24  # partial designs kept from one round to the next


def round_orders(names: list[str], num_rounds: int, seed: str) -> list[list[str]]:
    """The order of ``names`` in each of ``num_rounds`` rounds (module docstring); ``seed`` seeds the
    candidates' order (ties) and, past ``EXHAUSTIVE_UP_TO`` names, the candidates themselves."""
    rng = random.Random(seed)
    m = len(names)
    if m < 2:
        return [list(names) for _ in range(num_rounds)]
    index = {c: i for i, c in enumerate(names)}
    # a partial design: (sum of squares of its counts, its rounds, place counts [config][place],
    # neighbour counts [(a, b)], the config that ended it)
    beam: list[tuple[int, list[list[str]], list[list[int]], dict[tuple[int, int], int], int | None]] = [
        (0, [], [[0] * m for _ in names], {}, None)
    ]
    for _ in range(num_rounds):
        if m <= EXHAUSTIVE_UP_TO:
            candidates = [list(p) for p in itertools.permutations(names)]
            rng.shuffle(candidates)
        else:
            candidates = []
            for _ in range(NUM_SAMPLES):
                p = list(names)
                rng.shuffle(p)
                candidates.append(p)
        grown = []
        for total, rounds, place, pairs, last in beam:
            for p in candidates:
                ids = [index[c] for c in p]
                if ids[0] == last:
                    continue
                # the sum of squares grows by 2 x count + 1 for each count this order adds one to
                cost = sum(2 * place[c][i] + 1 for i, c in enumerate(ids))
                links = list(zip(ids, ids[1:])) + ([(last, ids[0])] if last is not None else [])
                cost += sum(2 * pairs.get(link, 0) + 1 for link in links)
                grown.append((total + cost, len(grown), rounds, place, pairs, p, ids, links))
        grown.sort(key=lambda g: (g[0], g[1]))
        beam = []
        for total, _, rounds, place, pairs, p, ids, links in grown[:BEAM]:
            place = [row[:] for row in place]
            for i, c in enumerate(ids):
                place[c][i] += 1
            pairs = dict(pairs)
            for link in links:
                pairs[link] = pairs.get(link, 0) + 1
            beam.append((total, [*rounds, p], place, pairs, ids[-1]))
    return beam[0][1]
