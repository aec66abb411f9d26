"""What the kernel tests share: running Triton kernels under the interpreter in a subprocess, and
compiling them for the H200 (sm_90) without a device (:func:`compile_sm90`).

``TRITON_INTERPRET`` is read when triton is imported, so a test module that also runs compiled
kernels on the GPU re-runs itself as ``python <test file> --interpreted`` with the variable set:
there :func:`run_jobs` runs each case and prints every result as one JSON line, and the test process
reads them back with :func:`interpreted_results` (a pytest fixture per module, one subprocess).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

from specsched.kernels.triton_utils import is_interpreted


def run_jobs(jobs: dict[str, Callable[[], dict]], header: dict[str, dict] | None = None) -> None:
    """Subprocess side: run each job; print ``{name: result}`` as one JSON line. A job that raises
    records its traceback as ``{"error": ...}`` (the test of that name fails on it) and the rest
    still run. ``header`` entries (e.g. ``_defect``) are printed with the results."""
    if is_interpreted():
        use_fixed_order_dot()
    results: dict[str, dict] = {"_interpreted": {"value": is_interpreted()}, **(header or {})}
    t0 = time.perf_counter()
    for name, job in jobs.items():
        try:
            results[name] = job()
        except Exception:  # reported to the parent test, which fails on it
            results[name] = {"error": traceback.format_exc()}
    results["_seconds"] = {"value": time.perf_counter() - t0}
    print(json.dumps(results))


def use_fixed_order_dot() -> None:
    """Make the interpreter's ``tl.dot`` a fixed-order reduction over K for every output element.
    The interpreter computes it with ``np.matmul``, i.e. the host's BLAS, and OpenBLAS's Zen and
    Haswell sgemm kernels give a row a result that depends on its place in the tile (an AMD EPYC
    dev box, 2026-12-06: the batch-invariance and fused-kernel equality tests failed there, at 1e-7
    to 1e-4, and passed with the Sandybridge kernel); a GPU's MMA does not. ``np.einsum`` without
    ``optimize`` never calls BLAS: each output element sums its K products in one order."""
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8 / int8: the stock path
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        out = np.einsum("...mk,...kn->...mn", a_data, b_data, dtype=acc, optimize=False)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    builder = interpreter.InterpreterBuilder
    original = getattr(builder.create_dot, "__wrapped__", builder.create_dot)
    create_dot.__wrapped__ = original
    builder.create_dot = create_dot


def interpreted_results(test_file: str, timeout_s: float = 300.0) -> dict[str, dict]:
    """Test side: run ``test_file --interpreted`` with ``TRITON_INTERPRET=1``; its results by name.
    Raises ``AssertionError`` when the subprocess fails or did not run Triton interpreted."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, test_file, "--interpreted"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise AssertionError(f"{test_file} --interpreted failed:\n{proc.stderr[-4000:]}")
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    if not results["_interpreted"]["value"]:
        raise AssertionError("the subprocess did not run Triton in interpreter mode")
    return results


H200_TARGET = ("cuda", 90, 32)


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, **options) -> dict:
    """``kernel`` compiled for sm_90 here (Triton's frontend and ptxas need no device): its ``asm``
    dict (``ptx``, ``cubin``, ...). Parameters not in ``types`` or ``constexprs`` are i32 (strides,
    counts); a PDL constexpr (``USE_PDL``, ``TRIGGER_FIRST``, ``PREFETCH``) not given is False.
    Raises ``ImportError`` / ``TypeError`` when this Triton lays the API out differently (callers
    skip on those)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = inspect.signature(kernel.fn).parameters
    constexprs = {**{c: False for c in ("USE_PDL", "TRIGGER_FIRST", "PREFETCH") if c in names}, **constexprs}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget(*H200_TARGET), options=options).asm
