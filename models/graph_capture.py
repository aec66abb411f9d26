"""What the graph runners share (models/cuda_graphs.py, models/piecewise_graphs.py,
models/draft_loop.py): a graph's capture after its warm-up, the attention backend it is captured on,
the CPU stand-in for a graph in tests, the pinned staging ring of the per-step upload, the device memory
a set of captures takes, and the stats every runner reports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def graph_stats(runner) -> dict:
    """What every graph runner (this module's, models/piecewise_graphs.py's) reports in its stats."""
    return {
        "name": runner.name,
        "num_graphs": runner.num_graphs,
        "graph_memory_mib": round(runner.graph_memory_bytes / 2**20, 1),
        "capture_s": round(runner.capture_s, 2),
        "num_replays": runner.num_replays,
        "num_eager_fallbacks": runner.num_eager_fallbacks,
    }


class EagerReplay:
    """CPU stand-in for a CUDAGraph (``emulate=True``, tests only): replay re-runs the captured
    function on the static buffers, which exercises the bucketing and padding but saves nothing."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def capture_graph(
    fn: Callable[[], None], device: torch.device, pool, warmup_stream: torch.cuda.Stream, num_warmup: int
) -> torch.cuda.CUDAGraph:
    """``fn`` captured into a CUDA graph allocating from ``pool``, after ``num_warmup`` eager runs on
    ``warmup_stream`` (Triton compiles and cuBLAS's choices happen there, outside the capture)."""
    warmup_stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(warmup_stream):
        for _ in range(num_warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(warmup_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


class Staging:
    """A ring of host staging buffers for the per-step upload: pinned on CUDA (the copy is then truly
    asynchronous), each guarded by an event recorded after its copy, so a buffer is rewritten only
    once the copy that read it has run (normally long done: the step's own host read waited for it)."""

    def __init__(self, nbytes: int, device: torch.device, size: int = 4) -> None:
        is_cuda = device.type == "cuda"
        self.host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=is_cuda) for _ in range(size)]
        self.arrays = [h.numpy() for h in self.host]  # numpy views of the same memory
        self.events = [torch.cuda.Event() if is_cuda else None for _ in range(size)]
        self.num_waits = 0  # times a buffer's previous copy had not run yet (a host wait)
        self._next = 0

    def acquire(self) -> int:
        i = self._next
        self._next = (i + 1) % len(self.host)
        ev = self.events[i]
        if ev is not None and not ev.query():
            self.num_waits += 1
            ev.synchronize()
        return i

    def copied(self, i: int) -> None:
        if self.events[i] is not None:
            self.events[i].record()


class CaptureMemory:
    """Context manager: the device memory the captures inside it took (``bytes``; free memory before
    and after, each read without the allocator's cached blocks). 0 off CUDA, or when the block raised."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.bytes = device, 0
        self._free0 = 0

    def _free(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    def __enter__(self) -> CaptureMemory:
        if self.device.type == "cuda":
            self._free0 = self._free()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.device.type == "cuda" and exc_type is None:
            self.bytes = max(0, self._free0 - self._free())


@contextmanager
def captured_backend(model, backend: str | None, is_emulated: bool) -> Iterator[None]:
    """The model's attention on ``backend`` while its graphs are captured (the one the graphs replay;
    None: the model's own), its own again afterwards; nothing switches for emulated graphs."""
    prev = model.attn_backend
    switch = not is_emulated and backend is not None and backend != prev
    if switch:
        model.set_attn_backend(backend)
    try:
        yield
    finally:
        if switch:
            model.set_attn_backend(prev)
