"""Where the circuit drawing's edges run: straight where no other node lies in the way, else a curve bent
around the nodes, so that an edge never passes over a node it does not touch and two edges never lie on
one line (an edge a -> c past b would hide a -> b and b -> c).

Distances are in pixels of the drawn figure (`Canvas`: the data ranges and the figure's plot size), the
same for x and y, so "in the way" means what a reader sees: an edge keeps NODE_PX from the centre of
every node (markers of 16 px) and PORT_PX from every q/k/v port (5 px) it does not end at. It is
straight when it can be; else the first curve that clears (one bend to a side, then an S of two
bends, growing); else the one that clears most.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NODE_PX, PORT_PX = 12.0, 6.0
BENDS_PX = tuple(b * sign for b in (20.0, 40.0, 60.0, 85.0, 115.0, 150.0, 200.0, 260.0) for sign in (1, -1))
SAMPLES = 33


@dataclass(frozen=True)
class Canvas:
    """Pixels per data unit on each axis."""

    sx: float
    sy: float

    @staticmethod
    def of(points: list[tuple[float, float]], width_px: float, height_px: float) -> Canvas:
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        return Canvas(width_px / max(1e-9, max(xs) - min(xs) + 1.0), height_px / max(1e-9, max(ys) - min(ys) + 0.6))


def clearance_px(xs: np.ndarray, ys: np.ndarray, obstacles: np.ndarray, canvas: Canvas) -> float:
    """The smallest margin (pixels) by which the polyline (xs, ys) clears the obstacles [k, 3] (x, y, the
    clearance it needs): distance to the obstacle's centre minus that clearance (negative: too close)."""
    if not len(obstacles):
        return float("inf")
    P = np.column_stack([xs * canvas.sx, ys * canvas.sy])
    Q = obstacles[:, :2] * np.array([canvas.sx, canvas.sy])
    # an obstacle farther than its clearance outside the polyline's bounding box clears it (a positive margin):
    # it cannot be the smallest margin where any is negative, nor change whether one is, so it is left out
    near = ((Q >= P.min(0) - obstacles[:, 2:]) & (Q <= P.max(0) + obstacles[:, 2:])).all(1)
    if not near.any():
        return float("inf")
    Q, obstacles = Q[near], obstacles[near]
    a, b = P[:-1], P[1:]
    ab = b - a
    t = ((Q[:, None, :] - a[None]) * ab[None]).sum(-1) / np.maximum((ab ** 2).sum(-1), 1e-12)[None]
    nearest = a[None] + np.clip(t, 0.0, 1.0)[..., None] * ab[None]
    return float((np.sqrt(((Q[:, None, :] - nearest) ** 2).sum(-1)).min(1) - obstacles[:, 2]).min())


def curve(p0: tuple[float, float], p1: tuple[float, float], bend_px: float, canvas: Canvas, s_bend: bool = False,
          n: int = SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """A curve from p0 to p1 pushed `bend_px` pixels sideways: one bend (a quadratic) or, with s_bend, an S
    (a cubic whose two control points go to opposite sides). bend 0: the straight line."""
    (x0, y0), (x1, y1) = p0, p1
    dx, dy = (x1 - x0) * canvas.sx, (y1 - y0) * canvas.sy
    length = max(1e-9, float(np.hypot(dx, dy)))
    nx, ny = -dy / length / canvas.sx, dx / length / canvas.sy  # the unit normal in pixels, in data units
    if not bend_px:
        return np.array([x0, x1], dtype=float), np.array([y0, y1], dtype=float)
    t = np.linspace(0.0, 1.0, n)
    if not s_bend:
        cx, cy = (x0 + x1) / 2 + 2 * bend_px * nx, (y0 + y1) / 2 + 2 * bend_px * ny
        return ((1 - t) ** 2 * x0 + 2 * (1 - t) * t * cx + t ** 2 * x1,
                (1 - t) ** 2 * y0 + 2 * (1 - t) * t * cy + t ** 2 * y1)
    c1 = (x0 + (x1 - x0) / 3 + 2 * bend_px * nx, y0 + (y1 - y0) / 3 + 2 * bend_px * ny)
    c2 = (x0 + 2 * (x1 - x0) / 3 - 2 * bend_px * nx, y0 + 2 * (y1 - y0) / 3 - 2 * bend_px * ny)
    w = [(1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t ** 2, t ** 3]
    return (w[0] * x0 + w[1] * c1[0] + w[2] * c2[0] + w[3] * x1, w[0] * y0 + w[1] * c1[1] + w[2] * c2[1] + w[3] * y1)


def route(p0: tuple[float, float], p1: tuple[float, float], obstacles: np.ndarray, canvas: Canvas
          ) -> tuple[np.ndarray, np.ndarray]:
    """The edge's path: straight when it clears every obstacle, else the first curve that does (the one
    that clears them most if none does)."""
    best, best_gap = curve(p0, p1, 0.0, canvas), -np.inf
    for s_bend in (False, True):
        for bend in ((0.0,) if not s_bend else ()) + BENDS_PX:
            xs, ys = curve(p0, p1, bend, canvas, s_bend)
            gap = clearance_px(xs, ys, obstacles, canvas)
            if gap >= 0:
                return xs, ys
            if gap > best_gap:
                best, best_gap = (xs, ys), gap
    return best
