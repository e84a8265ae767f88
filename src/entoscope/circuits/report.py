"""The `circuits` section of `entoscope report`: the model's induction circuit by EAP-IG.

Head scores (repeated random tokens, period 20) name the strongest previous-token and induction
heads; the section says where EAP-IG ranks the K-composition routes between them (the edge
a{prev}.h{p} -> a{ind}.h{i}<k>, or the same through an MLP in between) and how faithful the top-k
circuit is.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from ..models.adapter import adapt
from ..registry import register


def k_composition_routes(model: Any, n: int = 16, period: int = 20,
                         min_score: float = 0.3) -> tuple[list[tuple[str, ...]], Any]:
    """Routes from each strong previous-token head to the key of each strong induction head in a later
    layer (strong: score >= min_score; else the best of each), and the head-score table.

    A route is the direct edge a{p}.h{ph}->a{i}.h{ih}<k>, or the two edges through an MLP between them,
    (a{p}.h{ph}->m{L}, m{L}->a{i}.h{ih}<k>) for p <= L < i: a small model may pass the previous token
    through an MLP before the induction head reads it (the demo model does, docs/circuits.md). Routes
    through an edge the model's graph does not have (parallel blocks: a{L} does not feed m{L}) are
    still listed; `route_rank` skips them.
    """
    from .head_scores import HeadScores

    a = adapt(model)
    data = {"task": "repeated_tokens", "n": n, "seed": 3, "params": {"length": period, "bos_token_id": a.bos_token_id}}
    table = HeadScores(period=period, kinds=["previous_token", "induction"]).run(model, data, quiet=True).table

    def strong(kind: str) -> list[tuple[int, int]]:
        sub = table[table.kind == kind].sort_values("score", ascending=False)
        picked = sub[sub.score >= min_score]
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


@register("report_section", "circuits")
def circuits_section(model: Any, folder: Path, quick: bool) -> tuple[str, str]:
    from ..report import section_html
    from .operation import Circuits

    n_edges = 20
    op = Circuits(method="eap_ig", steps=5, metric="logit_diff", n_edges=n_edges, stability=100)
    result = op.run(model, {"task": "induction", "n": 16 if quick else 48, "seed": 11}, quiet=True)
    result.save(folder, assets_dir=folder.parent)
    s = result.summary
    routes, _ = k_composition_routes(model, n=8 if quick else 16)
    ranks = result.table.set_index("edge")["rank"]
    ranked = sorted((r, route) for route in routes if (r := route_rank(route, ranks)) is not None)
    found = [f"{' + '.join(route)} (weakest edge rank {r} of {s['n_edges_total']})" for r, route in ranked[:4]]
    lines = [
        f"EAP-IG ({op.steps} steps, {op.rule} rule) on the induction task, metric logit_diff; "
        f"clean {s['m_full']:.3f}, corrupt {s['m_empty']:.3f}.",
        f"Top-{n_edges} circuit: {s['n_kept']} edges ({s['n_kept_pruned']} after pruning), metric "
        f"{s['m_circuit']:.3f}, faithfulness {_ci(s, 'faithfulness')}; CPR {_ci(s, 'cpr')}, CMD {_ci(s, 'cmd')} "
        "over MIB's edge fractions (95% bootstrap intervals over prompts).",
        stability_sentence(s),
        "Previous-token head -> induction head key, directly or through an MLP, best routes: "
        + ("; ".join(found) if found else "no such pair of heads"),
    ]
    body = "".join(f"<p>{html.escape(line)}</p>" for line in lines)
    ioi = Circuits(method="eap_ig", steps=5, metric="logit_diff", n_edges=n_edges, stability=100,
                   faithfulness=[]).run(model, {"task": "ioi", "n": 16 if quick else 48, "seed": 11}, quiet=True)
    ioi.save(folder / "ioi", assets_dir=folder.parent)
    t = ioi.summary
    sentence = f"Faithfulness {_ci(t, 'faithfulness')}. {stability_sentence(t)}"
    body += (f"<h3>IOI circuit (EAP-IG, top {n_edges})</h3><p>{html.escape(sentence)}</p>"
             f'<p><a href="{folder.name}/ioi/index.html">IOI circuit: full results</a></p>')
    return ("induction and IOI circuits (EAP-IG)", body + section_html(result))


def _ci(s: dict[str, Any], key: str) -> str:
    low, high = s.get(f"{key}_ci_low"), s.get(f"{key}_ci_high")
    if low is None or high is None:
        return f"{s[key]:.3f}"
    return f"{s[key]:.3f} [{low:.3f}, {high:.3f}]"


def stability_sentence(s: dict[str, Any]) -> str:
    """Circuit stability in one sentence (summary keys of a Circuits run with stability > 0)."""
    if "stability_resamples" not in s:
        return ""
    text = (f"Over {s['stability_resamples']} bootstrap resamples of the prompts the top-{s['n_kept']} circuit is chosen "
            f"again each time: mean pairwise Jaccard {s['stability_jaccard']:.2f} (with the full-data circuit "
            f"{s['stability_jaccard_to_full']:.2f}); {s['n_stable']} edges are kept in at least "
            f"{s['stability_share']:.0%} of resamples (the stable circuit)")
    if "stable_faithfulness" in s:
        text += f", faithfulness {_ci(s, 'stable_faithfulness')}"
    return text + "."
