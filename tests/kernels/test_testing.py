"""kernels/testing.py: the interpreter's dot as a fixed-order reduction (use_fixed_order_dot)."""

from __future__ import annotations

import numpy as np
import pytest

interpreter = pytest.importorskip("triton.runtime.interpreter")
tl = pytest.importorskip("triton.language")


def dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    h = interpreter.TensorHandle
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    out = interpreter.InterpreterBuilder.create_dot(
        None, h(a, tl.float32), h(b, tl.float32), h(acc, tl.float32), None, None
    )
    return out.data


def test_a_row_of_the_fixed_order_dot_does_not_depend_on_its_place_in_the_tile():
    from specsched.kernels.testing import use_fixed_order_dot

    use_fixed_order_dot()
    use_fixed_order_dot()  # twice: still one wrapper around the stock dot
    rng = np.random.default_rng(0)
    for m, k, n in ((64, 96, 32), (16, 256, 64), (33, 128, 48)):
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        tile = dot(a, b)
        for r in (0, m // 2, m - 1):
            assert np.array_equal(tile[r], dot(a[r : r + 1], b)[0]), (m, k, n, r)
        assert np.allclose(tile, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-4, atol=1e-4)
    wrapped = interpreter.InterpreterBuilder.create_dot
    assert wrapped.__wrapped__ is not wrapped and not hasattr(wrapped.__wrapped__, "__wrapped__")
