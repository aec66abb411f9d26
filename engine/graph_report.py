"""Every CUDA-graph runner an engine holds, and what each reports: the scorers' (and the eager MQA
scorer's piecewise graphs), the prefill chunks', the draft's single steps' and its loop graphs'
(graphs, memory, capture seconds, replays, and the forwards that ran eagerly outside them). The daemon
puts it in ``stats`` (``engine.graphs``): a replay count that stays at 0 or eager fallbacks that grow
say a shape runs outside its graphs."""

from __future__ import annotations


def graph_runners(engine) -> dict[str, object]:
    """``{name: runner}``: the scorers' runners named by the scorers that share them (batch expansion
    and the MQA graph share the target's, ``scorers batch_expansion+mqa_graph``), then ``prefill``,
    then each draft proposer's single-step graphs and loop graphs."""
    found: dict[str, object] = {}
    shared: dict[int, tuple[object, list[str]]] = {}  # id(runner) -> (runner, the scorers on it)
    for name, scorer in engine.scorers.items():
        for attr, suffix in (("runner", ""), ("piecewise", " piecewise")):
            runner = getattr(scorer, attr, None)
            if runner is not None:
                shared.setdefault(id(runner), (runner, []))[1].append(name + suffix)
    for runner, names in shared.values():
        found["scorers " + "+".join(names)] = runner

    def add(name: str, runner) -> None:
        if runner is not None:
            found[name] = runner

    add("prefill", getattr(engine, "prefill_runner", None))
    for name, prop in engine.proposers.items():
        draft = getattr(prop, "draft", None) or prop  # a synthetic proposer's paid draft
        forward = getattr(draft, "graph_forward", None)
        add(f"proposer {name}", getattr(forward, "runner", None))
        add(f"proposer {name} loop", getattr(draft, "loop_graphs", None))
    return found


def graph_stats(engine) -> dict[str, dict]:
    """Each runner's ``stats()`` (:func:`graph_runners`); empty without graphs (the CPU path)."""
    return {name: runner.stats() for name, runner in graph_runners(engine).items()}
