"""The report's circuits section: the induction and IOI circuits by EAP-IG, their faithfulness and stability.

Its sizes follow the model's cost (report/sizes.py): on a large model `--quick` scores edges by EAP (one
backward a prompt) instead of EAP-IG, and the faithfulness curve is read at 4 of MIB's 10 edge fractions
(CPR and CMD are then areas over those 4); the page says which.

Head scores (repeated random tokens, period 20) name the strongest previous-token and induction heads;
the section says where EAP-IG ranks the K-composition routes between them (circuits/routes.py).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from ...circuits.faithfulness import MIB_FRACTIONS
from ...registry import register
from ...results.claims import TakeawayBuilder
from ...stats import value_with_ci
from ...stats.columns import level_text
from ..preflight import runs_by
from ..section import Section, result_html, run_saved
from ..sizes import COARSE_FRACTIONS, sizes


N_EDGES = 20


def circuits_runs(model: Any, quick: bool) -> list[tuple[Any, Any]]:
    """EAP-IG on induction, then on IOI (no faithfulness curve there)."""
    from ...circuits import Circuits

    size = sizes(model, "circuits", quick)
    n, how = size["n"], {"method": size["method"], "steps": size["steps"]}
    curve = list(MIB_FRACTIONS if size["faithfulness"] == "mib" else COARSE_FRACTIONS)
    return [(Circuits(**how, metric="logit_diff", n_edges=N_EDGES, stability=100, faithfulness=curve),
             {"task": "induction", "n": n, "seed": 11}),
            (Circuits(**how, metric="logit_diff", n_edges=N_EDGES, stability=100, faithfulness=[]),
             {"task": "ioi", "n": n, "seed": 11})]


def method_label(op: Any) -> str:
    """How the edges were scored, as the page names it."""
    return f"EAP-IG ({op.steps} steps, {op.rule} rule)" if op.method == "eap_ig" else op.method.upper()


@register("report_section", "circuits")
@runs_by(circuits_runs)
def circuits_section(model: Any, folder: Path, quick: bool) -> Section:
    from ...circuits.routes import k_composition_routes, route_rank

    n_edges = N_EDGES
    (op, data), (ioi_op, ioi_data) = circuits_runs(model, quick)
    result = run_saved(op, model, data, folder, folder.parent)
    s = result.summary
    routes, _ = k_composition_routes(model, n=sizes(model, "circuits", quick)["routes_n"])
    ranks = result.table.set_index("edge")["rank"]
    ranked = sorted((r, route) for route in routes if (r := route_rank(route, ranks)) is not None)
    found = [f"{' + '.join(route)} (weakest edge rank {r} of {s['n_edges_total']})" for r, route in ranked[:4]]
    fractions = "MIB's edge fractions" if list(op.faithfulness) == list(MIB_FRACTIONS) else \
        f"the edge fractions {', '.join(f'{f:g}' for f in op.faithfulness)} (of MIB's {len(MIB_FRACTIONS)})"
    lines = [
        f"{method_label(op)} on the induction task ({data['n']} prompts), metric logit difference; "
        f"clean {s['m_full']:.3f}, corrupt {s['m_empty']:.3f}.",
        f"Top-{n_edges} circuit: {s['n_kept']} edges ({s['n_kept_pruned']} after pruning), metric "
        f"{s['m_circuit']:.3f}, faithfulness {value_with_ci(s, 'faithfulness', '.3f')}; "
        f"CPR {value_with_ci(s, 'cpr', '.3f')}, CMD {value_with_ci(s, 'cmd', '.3f')} over {fractions} "
        f"({level_text(s.get('ci_level', 0.95))} bootstrap intervals over prompts).",
        stability_sentence(s),
        "Previous-token head -> induction head key, directly or through an MLP, best routes: "
        + ("; ".join(found) if found else "no such pair of heads"),
    ]
    name = "EAP-IG" if op.method == "eap_ig" else op.method.upper()
    body = f"<h3>induction circuit ({name}, top {n_edges} edges)</h3>" + "".join(f"<p>{html.escape(line)}</p>"
                                                                            for line in lines)
    body += result_html(result, figures=2, lead=False)
    ioi = run_saved(ioi_op, model, ioi_data, folder / "ioi", folder.parent)
    t = ioi.summary
    sentence = f"Faithfulness {value_with_ci(t, 'faithfulness', '.3f')}. {stability_sentence(t)}"
    body += (f"<h3>IOI circuit ({name}, top {n_edges} edges, {ioi_data['n']} prompts)</h3>"
             f"<p>{html.escape(sentence)}</p>"
             + result_html(ioi, figures=1, lead=False, max_rows=8)
             + f'<p class="more"><a href="{folder.name}/ioi/index.html">IOI circuit: every figure and the whole '
             "table</a></p>")
    lead = TakeawayBuilder(key=())
    here, ioi_file = f"{folder.name}/summary.json", f"{folder.name}/ioi/summary.json"
    lead.say(f"The induction task's {name} circuit of ")
    lead.quote(s, "n_kept", fmt="d", name=False, interval=False, source=here)
    lead.say(" edges recovers ")
    lead.quote(s, "faithfulness", name=False, source=here)
    lead.say(" of the model's logit difference (faithfulness)")
    if "stability_jaccard" in s:
        lead.say("; its edges are chosen again with mean Jaccard ")
        lead.quote(s, "stability_jaccard", name=False, interval=False, source=here)
        lead.say(" over resamples of the prompts")
    lead.say(". The IOI circuit: faithfulness ")
    lead.quote(t, "faithfulness", name=False, source=ioi_file)
    if "stability_jaccard" in t:
        lead.say(", Jaccard ")
        lead.quote(t, "stability_jaccard", name=False, interval=False, source=ioi_file)
    lead.say(" (")
    lead.quote(s, "ci_level", fmt=".0%", name=False, interval=False, source=here)
    lead.say(" intervals over prompts).")
    return Section(f"induction and IOI circuits ({name})", lead.build(), body,
                   terms=(name, "faithfulness", "CPR", "CMD", "stable circuit", "95% interval", "q-value", "names"))


def stability_sentence(s: dict[str, Any]) -> str:
    """Circuit stability in one sentence (summary keys of a Circuits run with stability > 0)."""
    if "stability_resamples" not in s:
        return ""
    text = (f"Over {s['stability_resamples']} bootstrap resamples of the prompts the top-{s['n_kept']} circuit is chosen "
            f"again each time: mean pairwise Jaccard {s['stability_jaccard']:.2f} (with the full-data circuit "
            f"{s['stability_jaccard_to_full']:.2f}); {s['n_stable']} edges are kept in at least "
            f"{s['stability_share']:.0%} of resamples (the stable circuit)")
    if "stable_faithfulness" in s:
        text += f", faithfulness {value_with_ci(s, 'stable_faithfulness', '.3f')}"
    return text + "."
