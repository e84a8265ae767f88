"""The `circuits` section of `entoscope report`: the model's induction circuit by EAP-IG.

Head scores (repeated random tokens, period 20) name the strongest previous-token and induction
heads; the section says where EAP-IG ranks the K-composition edges between them
(a{prev}.h{p} -> a{ind}.h{i}<k>) and how faithful the top-k circuit is.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from ..models.adapter import adapt
from ..registry import register


def k_composition_edges(model: Any, n: int = 16, period: int = 20, min_score: float = 0.3) -> tuple[list[str], Any]:
    """Edges from each strong previous-token head to the key of each strong induction head in a later
    layer (strong: score >= min_score; else the best of each), and the head-score table."""
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
    edges = [f"a{pl}.h{ph}->a{il}.{kv}{ih // g}<k>" for pl, ph in strong("previous_token")
             for il, ih in strong("induction") if pl < il]
    return edges, table


@register("report_section", "circuits")
def circuits_section(model: Any, folder: Path, quick: bool) -> tuple[str, str]:
    from ..report import section_html
    from .operation import Circuits

    n_edges = 20
    op = Circuits(method="eap_ig", steps=5, metric="logit_diff", n_edges=n_edges)
    result = op.run(model, {"task": "induction", "n": 16 if quick else 48, "seed": 11}, quiet=True)
    result.save(folder, assets_dir=folder.parent)
    s = result.summary
    edges, _ = k_composition_edges(model, n=8 if quick else 16)
    ranks = result.table.set_index("edge")["rank"]
    found = [f"{e} (rank {int(ranks[e])} of {s['n_edges_total']})" for e in edges if e in ranks.index]
    lines = [
        f"EAP-IG ({op.steps} steps, {op.rule} rule) on the induction task, metric logit_diff; "
        f"clean {s['m_full']:.3f}, corrupt {s['m_empty']:.3f}.",
        f"Top-{n_edges} circuit: {s['n_kept']} edges ({s['n_kept_pruned']} after pruning), metric "
        f"{s['m_circuit']:.3f}, faithfulness {s['faithfulness']:.3f}; CPR {s['cpr']:.3f}, CMD {s['cmd']:.3f} "
        "over MIB's edge fractions.",
        "Previous-token -> induction head K-composition: " + ("; ".join(found) if found else "no such pair of heads"),
    ]
    body = "".join(f"<p>{html.escape(line)}</p>" for line in lines)
    return ("induction circuit (EAP-IG)", body + section_html(result))
