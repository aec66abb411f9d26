"""Recursive least squares with forgetting: the online linear fit behind every cost model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import mul

import numpy as np

__all__ = ["OnlineLinearModel"]


class OnlineLinearModel:
    """y ≈ max(0, w·x), fitted by exponentially weighted recursive least squares (RLS).

    Haykin, *Adaptive Filter Theory* (4th ed., 2002), Table 9.1 (the RLS algorithm) with forgetting
    factor λ in (0, 1]: with P the inverse weighted correlation matrix of the features,
    ``g = P x / (λ + xᵀ P x)``, ``w ← w + g (y − wᵀ x)``, ``P ← (P − g xᵀ P) / λ``. Past samples
    weigh λ^age (memory ≈ 1 / (1 − λ) samples), so the fit follows drift. Prior: ``w = coef``,
    ``P = diag(prior_var)`` (large = weak). Against covariance wind-up in directions the data does
    not excite (P grows by 1/λ per step there), each diagonal entry is capped at its prior variance
    by a symmetric rescaling D P D, which keeps P positive semidefinite.
    """

    def __init__(
        self,
        num_features: int,
        forgetting: float = 0.99,
        prior_var: float | Sequence[float] = 1e4,
        coef: Sequence[float] | None = None,
    ) -> None:
        if num_features < 1:
            raise ValueError(f"num_features must be >= 1, got {num_features}")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting factor must be in (0, 1], got {forgetting}")
        self.forgetting = float(forgetting)
        self.prior_var = np.broadcast_to(np.asarray(prior_var, dtype=np.float64), (num_features,)).copy()
        if np.any(self.prior_var <= 0):
            raise ValueError(f"prior_var must be > 0, got {self.prior_var.tolist()}")
        self.coef = np.zeros(num_features) if coef is None else np.asarray(coef, dtype=np.float64).copy()
        if self.coef.shape != (num_features,):
            raise ValueError(f"coef must have {num_features} entries, got {len(self.coef)}")
        self.cov = np.diag(self.prior_var)  # [F, F]
        self.num_updates = 0

    # The state lives in Python lists: an update of a handful of features is ~F² float operations,
    # which plain Python does several times faster than numpy's per-call overhead on F×F arrays.
    @property
    def coef(self) -> np.ndarray:  # [F] float64; assign a new array to change it (not in place)
        found = self._coef
        if found is None:
            found = self._coef = np.array(self._coef_list, dtype=np.float64)
        return found

    @coef.setter
    def coef(self, value: Sequence[float] | np.ndarray) -> None:
        self._coef = np.asarray(value, dtype=np.float64)
        self._coef_list = self._coef.tolist()  # python floats: predict multiplies no numpy scalars

    @property
    def coef_list(self) -> list[float]:  # [F] the coefficients as Python floats (do not modify)
        return self._coef_list

    @property
    def cov(self) -> np.ndarray:  # [F, F] float64, a copy
        return np.array(self._cov, dtype=np.float64)

    @cov.setter
    def cov(self, value) -> None:
        self._cov = np.asarray(value, dtype=np.float64).tolist()

    @property
    def prior_var(self) -> np.ndarray:  # [F] float64
        return self._prior_var

    @prior_var.setter
    def prior_var(self, value) -> None:
        self._prior_var = np.asarray(value, dtype=np.float64)
        self._prior_var_list = self._prior_var.tolist()

    @property
    def num_features(self) -> int:
        return len(self._coef_list)

    def predict(self, x: Sequence) -> float | np.ndarray:
        """max(0, w·x); entries of ``x`` may be arrays of one shape (then an array comes back)."""
        if len(x) != len(self._coef_list):
            raise ValueError(f"expected {self.num_features} features, got {len(x)}")
        y = sum(map(mul, self._coef_list, x))
        return np.maximum(y, 0.0) if isinstance(y, np.ndarray) else max(float(y), 0.0)

    def update(self, x: Sequence[float], y: float) -> None:
        """One RLS step (see class) on sample ``x`` ``[F]``, ``y``: in Python floats, P kept
        exactly symmetric (its upper triangle is computed and mirrored)."""
        w = self._coef_list
        num = len(w)
        if len(x) != num or (isinstance(x, np.ndarray) and x.ndim != 1):
            raise ValueError(f"expected {num} features, got shape {np.shape(x)}")
        x = [float(v) for v in x]
        if not (all(map(math.isfinite, x)) and math.isfinite(y)):
            raise ValueError(f"non-finite sample x={x}, y={y}")
        lam, cov = self.forgetting, self._cov
        px = [sum(map(mul, row, x)) for row in cov]  # P x
        den = lam + sum(map(mul, x, px))
        gain = [v / den for v in px]  # g = P x / (λ + xᵀ P x)
        err = float(y) - sum(map(mul, w, x))
        self._coef_list = [wi + gi * err for wi, gi in zip(w, gain)]
        self._coef = None  # the array is rebuilt on access
        # P ← ((P − g (P x)ᵀ) / λ + its transpose) / 2 (symmetrised against rounding drift); P is
        # symmetric, so entry (i, j) and (j, i) come from the same two terms
        new = [[0.0] * num for _ in range(num)]
        for i in range(num):
            row, gi, pxi, out = cov[i], gain[i], px[i], new[i]
            for j in range(i, num):
                a = (row[j] - gi * px[j]) / lam
                b = (cov[j][i] - gain[j] * pxi) / lam
                out[j] = new[j][i] = (a + b) * 0.5
        prior = self._prior_var_list
        if any(new[i][i] > prior[i] for i in range(num)):  # wind-up: cap the diagonal by D P D
            scale = [math.sqrt(min(1.0, prior[i] / max(new[i][i], 1e-300))) for i in range(num)]
            new = [[v * (si * sj) for v, sj in zip(row, scale)] for row, si in zip(new, scale)]
        self._cov = new
        self.num_updates += 1

    def state_dict(self) -> dict:
        return {
            "coef": self.coef.tolist(),
            "cov": self.cov.tolist(),
            "prior_var": self.prior_var.tolist(),
            "num_updates": self.num_updates,
            "forgetting": self.forgetting,
        }

    def load_state_dict(self, state: dict) -> None:
        n = self.num_features
        coef = np.asarray(state["coef"], dtype=np.float64)
        cov = np.asarray(state["cov"], dtype=np.float64)
        prior_var = np.asarray(state.get("prior_var", self.prior_var), dtype=np.float64)
        if coef.shape != (n,) or cov.shape != (n, n) or prior_var.shape != (n,):
            raise ValueError(
                f"state shapes {coef.shape}, {cov.shape}, {prior_var.shape} do not fit {n} features"
            )
        if not (np.all(np.isfinite(coef)) and np.all(np.isfinite(cov))):
            raise ValueError("state holds non-finite numbers")
        forgetting = float(state.get("forgetting", self.forgetting))
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting factor must be in (0, 1], got {forgetting}")
        self.coef, self.cov, self.prior_var = coef, cov, prior_var
        self.num_updates = int(state.get("num_updates", 0))
        self.forgetting = forgetting
