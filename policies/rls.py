"""Recursive least squares with forgetting: the online linear fit behind every cost model."""

from __future__ import annotations

import math
from collections.abc import Sequence

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

    @property
    def coef(self) -> np.ndarray:  # [F] float64; assign a new array to change it (not in place)
        return self._coef

    @coef.setter
    def coef(self, value: Sequence[float] | np.ndarray) -> None:
        self._coef = np.asarray(value, dtype=np.float64)
        self._coef_list = self._coef.tolist()  # python floats: predict multiplies no numpy scalars

    @property
    def num_features(self) -> int:
        return len(self.coef)

    def predict(self, x: Sequence) -> float | np.ndarray:
        """max(0, w·x); entries of ``x`` may be arrays of one shape (then an array comes back)."""
        if len(x) != self.num_features:
            raise ValueError(f"expected {self.num_features} features, got {len(x)}")
        y = sum(w * xi for w, xi in zip(self._coef_list, x, strict=True))
        return np.maximum(y, 0.0) if isinstance(y, np.ndarray) else max(float(y), 0.0)

    def update(self, x: Sequence[float], y: float) -> None:
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (self.num_features,):
            raise ValueError(f"expected {self.num_features} features, got shape {x.shape}")
        if not (np.isfinite(x).all() and math.isfinite(y)):
            raise ValueError(f"non-finite sample x={x.tolist()}, y={y}")
        lam = self.forgetting
        px = self.cov @ x
        gain = px / (lam + x @ px)
        self.coef = self.coef + gain * (float(y) - self.coef @ x)
        cov = self.cov - gain[:, None] * px  # P - g (P x)ᵀ; P x = (xᵀ P)ᵀ as P is symmetric
        cov /= lam
        cov += cov.T  # symmetrise against rounding drift (numpy buffers the overlapping transpose)
        cov *= 0.5
        diag = cov.diagonal()
        if (diag > self.prior_var).any():
            scale = np.sqrt(np.minimum(1.0, self.prior_var / np.maximum(diag, 1e-300)))
            cov *= scale[:, None] * scale
        self.cov = cov
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
