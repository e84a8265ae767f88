"""Finding a circuit by its faithfulness (`selection: target`): the smallest top-n edge set the search finds that
recovers at least `target` of the metric, searched along the faithfulness curve and refined between its points.

The points. The edges are ranked once, by |score| (the run's edge scores: EAP, EAP-IG, exact); a point is the top
n edges, and its faithfulness f(n) = (m(top n) - m(empty)) / (m(full) - m(empty)) is one patched evaluation
(circuits/faithfulness.py; m a mean over prompts). The search reads the curve's points of at most `budget` edges,
and the top `budget` edges themselves (the budget's point, evaluated with the curve where the curve has no point
there); f(0) = 0 (no edge kept is the corrupt run).

The search. hi = the fewest edges among the points read with f >= target; lo = the most edges among the points
below hi (0 if none). While hi - lo > 1 and steps are left, the top mid = (lo + hi) // 2 edges are evaluated
and replace hi (f(mid) >= target) or lo (else): bisection, one patched evaluation a step, so `steps` steps narrow
the first bracket the curve gives to 2^-steps of its width. The circuit found is the top hi edges, pruned to the
edges on a path from the input to the logits (`Circuit.pruned`: the pruned circuit gives the same output, so the
same faithfulness, and is connected). f need not rise with n: "smallest" is the smallest n among the points the
search read, not over every n.

No point of at most `budget` edges reaching the target: nothing is found, and the run says "no circuit of `budget`
edges or fewer reaches the target ... recover at most f_best" (the best point read) and where the curve first reaches
it; the search takes no step then.

The target and "found" use the point estimate of f (a ratio of means over prompts); the faithfulness quoted with
it carries its bootstrap interval over prompts (docs/circuits.md, docs/pages.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
from torch import Tensor

from ..stats import Stats
from .faithfulness import faithfulness, faithfulness_summary, top_n
from .graph import Circuit, ComponentGraph


@dataclass(frozen=True)
class SearchOutcome:
    """Where the search ended: `found` (a point reached the target), `n` (the top-n edges of the circuit found,
    or of the best point read when none was), its faithfulness `f`, and every point read, in the order read."""

    found: bool
    n: int
    f: float
    points: tuple[tuple[int, float], ...]


def start_points(curve_ns: Sequence[int], budget: int) -> list[int]:
    """The points the search reads before any step: the curve's of at most `budget` edges (n >= 1), and the budget."""
    return sorted({n for n in curve_ns if 1 <= n <= budget} | {budget})


def bracket(points: Mapping[int, float], target: float, budget: int) -> tuple[int, int] | None:
    """(lo, hi): hi the fewest edges (<= budget) with f >= target, lo the most below it (0: the empty circuit);
    None where no point reaches the target."""
    ns = sorted(n for n in points if n <= budget)
    reached = [n for n in ns if points[n] >= target]
    if not reached:
        return None
    hi = reached[0]
    below = [n for n in ns if n < hi]
    return (below[-1] if below else 0), hi


def next_n(points: Mapping[int, float], target: float, budget: int) -> int | None:
    """The next point to evaluate (the bracket's midpoint), or None where the search is done."""
    b = bracket(points, target, budget)
    if b is None or b[1] - b[0] <= 1:
        return None
    return (b[0] + b[1]) // 2


def outcome(points: Sequence[tuple[int, float]], target: float, budget: int) -> SearchOutcome:
    """The circuit found (the top hi edges) or, where none reached the target, the best point read."""
    table = dict(points)
    b = bracket(table, target, budget)
    if b is not None:
        return SearchOutcome(True, b[1], table[b[1]], tuple(points))
    within = [(f, -n) for n, f in table.items() if n <= budget]
    f, neg = max(within)
    return SearchOutcome(False, -neg, f, tuple(points))


def search_rows(graph: ComponentGraph, scores: Tensor, points: Sequence[tuple[int, str]], values: Mapping[int, Tensor],
                full: Tensor, empty: Tensor, absolute: bool, stats: Stats, seed: int) -> pd.DataFrame:
    """The faithfulness table's rows of the points the search read that are not the curve's, (n, kind) with kind
    "budget" (the budget's own point, measured with the curve) or "search" (a step's): fraction n / n_edges,
    n_edges, the edges left after pruning, metric, faithfulness with its bootstrap interval over prompts (the
    curve's columns) and `point` (the kind). values[n]: the top n edges' per-prompt metrics."""
    out = []
    for n, kind in points:
        v = values[n]
        m = float(v.mean())
        f = faithfulness_summary(v, full, empty, stats, seed)
        out.append({"fraction": n / graph.n_edges, "n_edges": n,
                    "n_edges_pruned": Circuit(graph, kept=top_n(graph, scores, n, absolute)).pruned().n_kept,
                    "metric": m, "faithfulness": faithfulness(m, float(empty.mean()), float(full.mean())),
                    "faithfulness_ci_low": float(f.ci_low[0]), "faithfulness_ci_high": float(f.ci_high[0]),
                    "ci_level": stats.ci_level, "point": kind})
    return pd.DataFrame(out, columns=["fraction", "n_edges", "n_edges_pruned", "metric", "faithfulness",
                                      "faithfulness_ci_low", "faithfulness_ci_high", "ci_level", "point"])
