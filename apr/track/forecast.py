"""The final validation loss, forecast from the curve so far (docs/runs.md, "Forecast").

The validation losses ``(step, loss)`` are fitted with a saturating power law in the step (tokens are
steps times a constant, so the same law): ``loss(s) = floor + scale * s ** -alpha``. For each
``alpha`` on a grid, ``floor`` and ``scale`` are an ordinary least-squares fit (a line in
``s ** -alpha``, ``scale`` > 0; all alphas in one vectorised pass); the ``alpha`` with the smallest
squared error wins. Each law's band is its forecast at ``total_steps`` plus and minus twice the root
of the residual variance plus the spread of the leave-one-out refits' forecasts: wide while few
points pin the curve, narrow once they agree.

Two laws are fitted: the free one, and the best one whose floor is at least 0 (a cross-entropy never
is below 0). On a curve still falling like a logarithm the free fit puts its floor far below 0 and
extrapolates more progress than comes (measured on the demo 5x longer: from half the run on, its
band missed the final loss; docs/performance.md). Where the free floor is >= 0 the two are one law.
Otherwise the forecast is the middle of the two laws' forecasts and its band spans both bands; the
law reported (``floor``, ``scale``, ``alpha``) is the one with floor >= 0. Pure numpy; nothing is
read from a GPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

MIN_POINTS = 4  # three parameters and one degree of freedom for the residuals
ALPHAS = np.geomspace(0.02, 3.0, 120)


@dataclass(frozen=True)
class Forecast:
    step: int  # the step forecast (the run's last)
    loss: float
    low: float
    high: float
    floor: float
    scale: float
    alpha: float
    points: int  # validation losses the fit used
    last_step: int  # the latest of them

    def to_dict(self) -> dict:
        return asdict(self)

    def contains(self, loss: float) -> bool:
        return self.low <= loss <= self.high


def _fit(steps: np.ndarray, losses: np.ndarray, nonneg: bool = False) -> tuple[float, float, float, float] | None:
    """(floor, scale, alpha, squared error) of the best law (``nonneg``: with floor >= 0), or None when
    no alpha fits a decreasing curve: the grid, then a finer one between the best point's neighbours."""
    best = _best(steps, losses, ALPHAS, nonneg)
    if best is None:
        return None
    i = int(np.argmin(np.abs(ALPHAS - best[2])))
    finer = np.linspace(ALPHAS[max(i - 1, 0)], ALPHAS[min(i + 1, len(ALPHAS) - 1)], 81)
    return _best(steps, losses, finer, nonneg) or best


def _best(steps: np.ndarray, losses: np.ndarray, alphas,
          nonneg: bool = False) -> tuple[float, float, float, float] | None:
    """The straight-line fit ``losses ~ floor + scale * steps ** -alpha`` for every alpha at once
    (closed-form least squares, one row per alpha; ``nonneg``: where the floor comes out below 0, the
    best law with floor 0 instead); the alpha of the smallest squared error among those with
    ``scale`` > 0, or None when none has."""
    alphas = np.asarray(alphas, dtype=np.float64)
    x = steps[None, :] ** -alphas[:, None]
    xc = x - x.mean(axis=1, keepdims=True)
    yc = losses - losses.mean()
    sxx = np.einsum("ij,ij->i", xc, xc)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(sxx > 0, (xc @ yc) / sxx, np.nan)
        floor = losses.mean() - scale * x.mean(axis=1)
        if nonneg:
            below = ~(floor >= 0)
            scale = np.where(below, (x @ losses) / np.einsum("ij,ij->i", x, x), scale)
            floor = np.where(below, 0.0, floor)
    sse = np.sum((floor[:, None] + scale[:, None] * x - losses[None, :]) ** 2, axis=1)
    ok = np.flatnonzero(scale > 0)
    if ok.size == 0:
        return None
    i = int(ok[np.argmin(sse[ok])])
    return float(floor[i]), float(scale[i]), float(alphas[i]), float(sse[i])


def _law(steps: np.ndarray, losses: np.ndarray, at: float, nonneg: bool):
    """(law, forecast at ``at``, band half-width) of one kind of law, or None."""
    fit = _fit(steps, losses, nonneg)
    if fit is None:
        return None
    floor, scale, alpha, sse = fit
    residual_var = sse / max(len(steps) - 3, 1)
    refits = []
    for i in range(len(steps)):  # leave-one-out: how much the forecast hangs on any one point
        keep = np.arange(len(steps)) != i
        f = _fit(steps[keep], losses[keep], nonneg)
        if f is not None:
            refits.append(f[0] + f[1] * at ** -f[2])
    spread = float(np.var(refits) * (len(refits) - 1)) if len(refits) > 1 else 0.0  # jackknife variance
    return fit, floor + scale * at ** -alpha, 2.0 * math.sqrt(residual_var + spread)


def forecast(points: list[tuple[int, float]], total_steps: int) -> Forecast | None:
    """The forecast final loss at ``total_steps`` from ``points`` (step, validation loss); None with
    fewer than ``MIN_POINTS`` finite points after step 0, or a curve no law fits (not decreasing)."""
    clean = sorted((int(s), float(v)) for s, v in points
                   if s is not None and v is not None and int(s) > 0 and math.isfinite(float(v)))
    if len(clean) < MIN_POINTS or total_steps <= 0:
        return None
    steps = np.array([s for s, _ in clean], dtype=np.float64)
    losses = np.array([v for _, v in clean], dtype=np.float64)
    at = float(total_steps)
    free = _law(steps, losses, at, nonneg=False)
    if free is None:
        return None
    laws = [free]
    if free[0][0] < 0:  # a floor below 0: the law held at floor >= 0 beside it
        held = _law(steps, losses, at, nonneg=True)
        laws += [held] if held is not None else []
    floor, scale, alpha, _ = laws[-1][0]
    predicted = sum(p for _, p, _ in laws) / len(laws)
    low, high = min(p - h for _, p, h in laws), max(p + h for _, p, h in laws)
    return Forecast(step=int(total_steps), loss=predicted, low=low, high=high, floor=floor, scale=scale, alpha=alpha,
                    points=len(clean), last_step=int(steps[-1]))
