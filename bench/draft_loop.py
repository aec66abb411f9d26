"""A greedy propose's latency with the draft's steps one replay each against the draft loop graphs.

``draft.loop_graphs`` (models/draft_loop.py) runs a greedy draft's single-token steps 2..k in one CUDA
graph replay instead of an upload and a launch each. This times ``DraftModelProposer.propose`` both
ways on the same model, cache and requests: each propose starts on an idle device after the catch-up of
a verified step at a context of ``--ctx`` keys (a draft with its own cache: two tokens, the last draft
and the bonus token; a self-draft on the target's cache: the last committed token, so that its whole
propose is the loop's one replay), and is timed to the end of its device work (bench/common.py
``time_ms``: what the engine's ``propose`` phase sees). The two ways alternate repeat by repeat; the
drafts are compared (the same tokens but where bf16 rounds a row of a batched step unlike a one-row
one).

``python -m specsched.bench.draft_loop [--drafts llama-68m smollm2-135m:8] [--batches 1 4 16 64]
[--ks 3 8] [--ctx 512] [--iters 100] [--repeats 3]`` (CUDA; ``--device cpu`` emulates both for a
smoke run). ``preset:L`` is a preset's first L layers as a self-draft on the target's cache (the
default draft, ``draft.shared_kv``); a plain preset is a draft with its own cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

import torch

from specsched.bench.common import device_name, random_model, time_ms
from specsched.bench.markdown import fmt, table
from specsched.engine.request import Request, SamplingParams
from specsched.proposers.draft import DraftModelProposer
from specsched.scorers.graph import GraphConfig, attach_draft_graphs

BLOCK = 16


def parse_draft(text: str) -> tuple[str, int | None]:
    preset, _, layers = text.partition(":")
    return preset, int(layers) if layers else None


def requests(batch: int, ctx: int, vocab: int, blocks_per_row: int) -> list[Request]:
    """``batch`` requests of ``ctx`` tokens each, in blocks of their own (block 0 is the pad block)."""
    gen = torch.Generator().manual_seed(batch)
    out = []
    for i in range(batch):
        table = list(range(1 + i * blocks_per_row, 1 + (i + 1) * blocks_per_row))
        prompt = torch.randint(3, vocab, (ctx,), generator=gen).tolist()
        r = Request(f"b{batch}-{i}", prompt, SamplingParams(), block_table=table)
        r.num_computed = r.num_tokens - 1  # the target's: a shared-cache self-draft catches up over 1
        out.append(r)
    return out


class Propose:
    """One greedy propose of ``k`` drafts for every request, after the catch-up of a verified step (the
    last draft and the bonus token); the last call's drafts in ``drafts``."""

    def __init__(self, prop: DraftModelProposer, reqs: list[Request], k: int, is_loop: bool) -> None:
        self.prop, self.reqs, self.k, self.is_loop = prop, reqs, k, is_loop
        self.drafts: torch.Tensor | None = None

    def __call__(self) -> None:
        self.prop.is_loop_used = self.is_loop
        for r in self.reqs:
            r.num_draft_computed = r.num_tokens - 2
        self.drafts = self.prop.propose(self.reqs, [self.k] * len(self.reqs)).draft_tokens


def time_draft(draft: str, batches: list[int], ks: list[int], args, device: torch.device) -> list[dict]:
    preset, layers = parse_draft(draft)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(preset, device, dtype, seed=1)
    blocks_per_row = -(-(args.ctx + max(ks) + 2) // BLOCK)
    num_blocks = 1 + max(batches) * blocks_per_row
    kv = model.allocate_kv_cache(num_blocks, BLOCK, layers)
    for k_cache, v_cache in kv:  # a context to attend to (its values do not matter for the timing)
        k_cache.normal_(0.0, 0.5)
        v_cache.normal_(0.0, 0.5)
    max_len = blocks_per_row * BLOCK
    cfg = GraphConfig(max_batch=max(batches), max_k=max(ks), max_model_len=max_len, progress=False,
                      emulate=device.type != "cuda", draft_loop=True)  # fmt: skip
    is_shared = layers is not None  # preset:L, a self-draft on the target's cache
    prop = DraftModelProposer(model, kv, BLOCK, layers, is_shared_kv=is_shared)
    attach_draft_graphs(prop, cfg, BLOCK)  # its own graphs and the loop's (is_loop_used picks the way)
    rows = []
    for b in batches:
        reqs = requests(b, args.ctx, model.cfg.vocab_size, blocks_per_row)
        for k in ks:
            ms: dict[str, list[float]] = {"steps": [], "loop": []}
            drafts: dict[str, torch.Tensor] = {}
            for _ in range(args.repeats):  # the two ways alternate: the machine's drift hits both
                for name in ("steps", "loop"):
                    call = Propose(prop, reqs, k, is_loop=name == "loop")
                    ms[name] += time_ms(call, device, 5, args.iters)
                    drafts[name] = call.drafts
            equal = (drafts["steps"] == drafts["loop"]).float().mean().item()
            med = {n: statistics.median(v) for n, v in ms.items()}
            rows.append({"draft": draft, "batch": b, "k": k, "steps_ms": med["steps"], "loop_ms": med["loop"],
                         "steps_p90": sorted(ms["steps"])[int(0.9 * (len(ms["steps"]) - 1))],
                         "loop_p90": sorted(ms["loop"])[int(0.9 * (len(ms["loop"]) - 1))],
                         "equal": equal, "misses": prop.loop_graphs.num_misses})  # fmt: skip
    capture = prop.loop_graphs.stats()
    print(f"{draft}: {capture['num_graphs']} loop graphs captured in {capture['capture_s']} s, "
          f"{capture['graph_memory_mib']} MiB (the draft's own graphs: "
          f"{prop.graph_forward.runner.stats()['capture_s']} s)", file=sys.stderr)  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", nargs="+", default=["llama-68m", "smollm2-135m:8"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 8])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--iters", type=int, default=100, help="timed proposes per way and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if min(args.ks) < 2 or min(args.batches) < 1 or args.ctx < 2 or args.iters < 1 or args.repeats < 1:
        ap.error(
            "every k must be >= 2 (k = 1 has no step to loop), batches, --iters, --repeats >= 1, --ctx >= 2"
        )
    device = torch.device(args.device)
    rows = [r for d in args.drafts for r in time_draft(d, args.batches, args.ks, args, device)]
    body = [[r["draft"], str(r["batch"]), str(r["k"]), f"{fmt(r['steps_ms'], 3)} ({fmt(r['steps_p90'], 3)})",
             f"{fmt(r['loop_ms'], 3)} ({fmt(r['loop_p90'], 3)})", fmt(r["loop_ms"] / r["steps_ms"], 2),
             f"{100 * r['equal']:.1f} %", str(r["misses"])] for r in rows]  # fmt: skip
    head = ["draft", "batch", "k", "one replay a step: ms (p90)", "loop graphs: ms (p90)", "loop / steps",
            "drafts equal", "loop misses"]  # fmt: skip
    sys.stdout.write(f"greedy propose latency, {device_name(device)}, ctx {args.ctx}, "
                     f"{args.repeats} x {args.iters} proposes a way\n\n{table(head, body)}\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
