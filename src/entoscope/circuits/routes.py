"""K-composition routes of an induction circuit: from each strong previous-token head to the key of each
strong induction head in a later layer, directly or through an MLP between them (docs/circuits.md)."""

from __future__ import annotations

from typing import Any

from ..models.adapter import adapt


def k_composition_routes(model: Any, n: int = 16, period: int = 20, min_score: float = 0.3,
                         kinds: tuple[str, ...] = ("previous_token", "induction")) -> tuple[list[tuple[str, ...]], Any]:
    """Routes from each strong previous-token head to the key of each strong induction head in a later
    layer (strong: a head that passes its kind's test, the head-score table's `passes`, docs/circuits.md; in a
    table without it, score >= min_score; where none is, the best of each), and the head-score table (of `kinds`,
    which hold the previous-token and induction kinds).

    A route is the direct edge a{p}.h{ph}->a{i}.h{ih}<k>, or the two edges through an MLP between them,
    (a{p}.h{ph}->m{L}, m{L}->a{i}.h{ih}<k>) for p <= L < i: a small model may pass the previous token
    through an MLP before the induction head reads it (the demo model does, docs/circuits.md). Routes
    through an edge the model's graph does not have (parallel blocks: a{L} does not feed m{L}) are
    still listed; `route_rank` skips them.
    """
    from .head_scores import HeadScores

    a = adapt(model)
    data = {"task": "repeated_tokens", "n": n, "seed": 3, "params": {"length": period, "bos_token_id": a.bos_token_id}}
    table = HeadScores(period=period, kinds=list(kinds)).run(model, data, quiet=True).table

    def strong(kind: str) -> list[tuple[int, int]]:
        sub = table[table.kind == kind].sort_values("score", ascending=False)
        picked = sub[sub["passes"].astype(bool)] if "passes" in sub else sub[sub.score >= min_score]
        rows = picked if len(picked) else sub.head(1)
        return [(int(r.layer), int(r.head)) for r in rows.itertuples()]

    kv = "kv" if a.structure.n_kv_heads != a.structure.n_heads else "h"
    g = a.structure.group_size
    routes: list[tuple[str, ...]] = []
    for pl, ph in strong("previous_token"):
        for il, ih in strong("induction"):
            if pl >= il:
                continue
            sender, key = f"a{pl}.h{ph}", f"a{il}.{kv}{ih // g}<k>"
            routes.append((f"{sender}->{key}",))
            routes += [(f"{sender}->m{mid}", f"m{mid}->{key}") for mid in range(pl, il)]
    return routes, table


def route_rank(route: tuple[str, ...], ranks: Any) -> int | None:
    """The rank of a route's weakest edge (its largest rank), or None if an edge is not in the graph."""
    if any(e not in ranks.index for e in route):
        return None
    return max(int(ranks[e]) for e in route)
