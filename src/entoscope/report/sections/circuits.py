"""The report's circuits section: the induction and IOI circuits found by their faithfulness, and the screened heads
they hold.

Each circuit is found, not fixed at a size (circuits/search.py, `selection: target`): the smallest top-n edge set
(by |score|) whose faithfulness reaches TARGET, with at most the budget's edges, searched along the faithfulness
curve and bisected between its points, pruned to the edges on a path from the input to the logits (connected).
Where no edge set of at most the budget reaches the target, the section says so ("no circuit of N edges or fewer
reaches ...", with the best read) and draws the curve, not a circuit.

Its sizes follow the model's cost (report/sizes.py): on a large model `--quick` scores edges by EAP (one backward a
prompt) instead of EAP-IG, the faithfulness curve is read at 4 of MIB's 10 edge fractions (CPR and CMD are then
areas over those 4), the budget is 5% of the edges and the search takes fewer steps; the page says which.

Head scores on repeated random tokens (period 20) name the heads of each kind that pass its test (the shuffled
control for duplicate-token and induction heads, most of the attention for previous-token heads; docs/circuits.md);
the section says which of them each circuit holds (heads.csv: a head is held when its output has a kept edge) and
where EAP ranks the K-composition routes between them (circuits/routes.py).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import pandas as pd

from ...circuits.faithfulness import MIB_FRACTIONS
from ...circuits.takeaway import beyond_budget, found_sentence
from ...models.adapter import adapt
from ...registry import register
from ...results.claims import TakeawayBuilder, join
from ...stats import value_with_ci
from ...stats.columns import level_text
from ..preflight import runs_by
from ..section import Section, result_html, run_saved
from ..sizes import COARSE_FRACTIONS, sizes

TARGET = 0.8  # the faithfulness a circuit must reach (its point estimate), as MIB's and EAP-IG's papers read "faithful"
KINDS = ("previous_token", "duplicate_token", "induction")  # the screened heads' kinds
HEADS = "heads.csv"  # per run folder: the screened heads, and whether the circuit holds each
NAMED = 3  # a circuit's heads of largest summed edge score named in the lead


def circuits_runs(model: Any, quick: bool) -> list[tuple[Any, Any]]:
    """The circuit search (selection target) on induction, then on IOI, with the same settings."""
    from ...circuits import Circuits
    from ...circuits.graph import ComponentGraph

    size = sizes(model, "circuits", quick)
    n, how = size["n"], {"method": size["method"], "steps": size["steps"]}
    curve = list(MIB_FRACTIONS if size["faithfulness"] == "mib" else COARSE_FRACTIONS)
    n_edges = ComponentGraph.from_structure(adapt(model).structure).n_edges
    search = {"selection": "target", "faithfulness_target": TARGET, "max_edges": max(1, int(size["budget"] * n_edges)),
              "search_steps": size["search_steps"]}
    return [(Circuits(**how, **search, metric="logit_diff", stability=100, faithfulness=curve),
             {"task": "induction", "n": n, "seed": 11}),
            (Circuits(**how, **search, metric="logit_diff", stability=100, faithfulness=curve),
             {"task": "ioi", "n": n, "seed": 11})]


def method_label(op: Any) -> str:
    """How the edges were scored, as the page names it."""
    return f"EAP-IG ({op.steps} steps, {op.rule} rule)" if op.method == "eap_ig" else op.method.upper()


def held_heads(result: Any, screened: pd.DataFrame) -> pd.DataFrame:
    """The screened heads (the head-score rows that pass their kind's test) and, for each, whether the circuit holds
    it: the head's output has a kept edge (for a circuit not found, the best edge set read)."""
    kept = result.circuit.kept.any(1)  # [n_senders]: an edge out of the sender is kept
    senders = result.circuit.graph.senders
    out = {name: bool(kept[i]) for i, name in enumerate(senders)}
    cols = [c for c in ("kind", "site", "score", "over_control", "passes") if c in screened]
    heads = screened[screened["passes"].astype(bool)][cols].copy()
    heads["in_circuit"] = [out.get(site, False) for site in heads["site"]]
    return heads.reset_index(drop=True)


@register("report_section", "circuits")
@runs_by(circuits_runs)
def circuits_section(model: Any, folder: Path, quick: bool) -> Section:
    from ...circuits.routes import k_composition_routes, route_rank

    (op, data), (ioi_op, ioi_data) = circuits_runs(model, quick)
    name = "EAP-IG" if op.method == "eap_ig" else op.method.upper()
    result = run_saved(op, model, data, folder, folder.parent)
    s = result.summary
    routes, screened = k_composition_routes(model, n=sizes(model, "circuits", quick)["routes_n"], kinds=KINDS)
    heads = held_heads(result, screened)
    heads.to_csv(folder / HEADS, index=False)
    ranks = result.table.set_index("edge")["rank"]
    ranked = sorted({(r, route) for route in routes if (r := route_rank(route, ranks)) is not None})  # heads sharing
    # a key/value head (grouped-query attention) give the same route once
    found = [f"{' + '.join(route)} (weakest edge rank {r} of {s['n_edges_total']})" for r, route in ranked[:4]]
    fractions = "MIB's edge fractions" if list(op.faithfulness) == list(MIB_FRACTIONS) else \
        f"the edge fractions {', '.join(f'{f:g}' for f in op.faithfulness)} (of MIB's {len(MIB_FRACTIONS)})"
    lines = [
        f"{method_label(op)} on the induction task ({data['n']} prompts), metric logit difference; "
        f"clean {s['m_full']:.3f}, corrupt {s['m_empty']:.3f}.",
        search_sentence(s),
        f"Faithfulness curve: CPR {value_with_ci(s, 'cpr', '.3f')}, CMD {value_with_ci(s, 'cmd', '.3f')} over "
        f"{fractions} ({level_text(s.get('ci_level', 0.95))} bootstrap intervals over prompts).",
        heads_sentence(heads, s),
        stability_sentence(s),
        "Previous-token head -> induction head key, directly or through an MLP, best routes: "
        + ("; ".join(found) if found else "no such pair of heads"),
    ]
    title = f"induction circuit ({name}, found by its faithfulness)" if s["found"] else \
        f"induction: no circuit found ({name}; the faithfulness curve)"
    body = f"<h3>{html.escape(title)}</h3>" + "".join(f"<p>{html.escape(line)}</p>" for line in lines if line)
    body += result_html(result, figures=2, lead=False)
    ioi = run_saved(ioi_op, model, ioi_data, folder / "ioi", folder.parent)
    t = ioi.summary
    ioi_heads = held_heads(ioi, screened)
    ioi_heads.to_csv(folder / "ioi" / HEADS, index=False)
    title = f"IOI circuit ({name}, {ioi_data['n']} prompts, found by its faithfulness)" if t["found"] else \
        f"IOI: no circuit found ({name}, {ioi_data['n']} prompts; the faithfulness curve)"
    ioi_lines = [search_sentence(t), heads_sentence(ioi_heads, t), stability_sentence(t)]
    body += (f"<h3>{html.escape(title)}</h3>" + "".join(f"<p>{html.escape(line)}</p>" for line in ioi_lines if line)
             + result_html(ioi, figures=1, lead=False, max_rows=8)
             + f'<p class="more"><a href="{folder.name}/ioi/index.html">IOI circuit: every figure and the whole '
             "table</a></p>")
    leads = []
    for task, summary, held, where in (("Induction", s, heads, folder.name),
                                       ("IOI", t, ioi_heads, f"{folder.name}/ioi")):
        one = TakeawayBuilder(key=())
        circuit_lead(one, task, summary, held, where, folder.parent)
        leads.append(one.build())
    lead = join(leads, labels=["Induction: ", "IOI: "])  # each task's lead, then each one's details
    found_ones = [task for task, summary in (("induction", s), ("IOI", t)) if summary["found"]]
    status = ("both found by their faithfulness" if len(found_ones) == 2 else
              f"{found_ones[0]} found by its faithfulness, the other not" if found_ones else
              "none found within the budget (the faithfulness curves)")
    return Section(f"induction and IOI circuits ({name}): {status}", lead, body,
                   terms=(name, "faithfulness", "circuit search", "head tests", "CPR", "CMD", "stable circuit",
                          "95% interval", "q-value", "names"))


def circuit_lead(b: TakeawayBuilder, task: str, s: dict[str, Any], heads: pd.DataFrame, where: str,
                 root: Path) -> None:
    """One task's takeaway: its lead, the circuit found (its size, faithfulness with its interval) or that none of
    at most the budget's edges was, with the best faithfulness read; its details, the found circuit's heads of
    largest summed edge score and the screened heads it holds, or where the curve reaches the target. `where`:
    the run's folder under the report's `root`; the task's name is said by the section (`join`'s labels)."""
    summary, held_file = f"{where}/summary.json", f"{where}/{HEADS}"
    if s["found"]:
        found_sentence(b, s, summary, opening="the smallest circuit found to recover ", of="the logit difference")
    else:
        b.say("no circuit of ")
        budget = b.quote(s, "max_edges", fmt=",d", name=False, key=(), source=summary, interval=False)
        b.say(" edges or fewer reaches the target faithfulness ")
        target = b.quote(s, "faithfulness_target", fmt="g", name=False, key=(), source=summary, interval=False)
        b.say("; the edge sets read recover ")
        word = b.qualify("at most", "none_reaches")
        b.say(" ")
        f = b.quote(s, "faithfulness", name=False, key=(), source=summary)
        b.refer(word, [f, target, budget])
        b.say(" of the logit difference.")
        b.end_lead()
        curve = root / where / "faithfulness.csv"
        beyond_budget(b, pd.read_csv(curve) if curve.exists() else None, target, source=f"{where}/faithfulness.csv",
                      opening=" The curve ", end="")
        b.say(" (the curve is drawn instead of a circuit).")
    nodes = pd.read_csv(Path(root) / where / "nodes.csv") if (Path(root) / where / "nodes.csv").exists() else None
    if s["found"] and nodes is not None:  # the heads that carry most of its edge scores
        top = nodes[(nodes["kind"] == "head") & (nodes["summed_score"] != 0)]
        top = top.reindex(top["summed_score"].abs().sort_values(ascending=False, kind="stable").index).head(NAMED)
        if len(top):
            b.say(" Its heads of ")
            word = b.qualify("largest", "top_by_abs", condition="kind=head")
            b.say(" summed |edge score|: ")
            refs = []
            for j, (_, row) in enumerate(top.iterrows()):
                b.say(", " if j else "")
                refs.append(b.quote(row, "summed_score", fmt="+.2g", key="node", source=f"{where}/nodes.csv"))
            b.refer(word, refs)
            b.say(".")
    held = heads[heads["in_circuit"].astype(bool)]
    if s["found"] and len(heads):
        b.say(" It holds ")
        if len(held):
            b.count(len(held), len(heads), "in_circuit", unit="heads the head scores name", source=held_file)
            b.say(": ")
            for j, (_, row) in enumerate(held.iterrows()):
                b.say(", " if j else "")
                if j == 0 or row["kind"] != held.iloc[j - 1]["kind"]:
                    b.say(f"{row['kind'].replace('_', '-')} ")
                b.mark(row, "in_circuit", key=("kind", "site"), source=held_file)
        else:
            b.count(0, len(heads), "in_circuit", unit="heads the head scores name", source=held_file)
        b.say(".")


def search_sentence(s: dict[str, Any]) -> str:
    """What the search read and found, in one sentence (the summary of a Circuits run with selection target)."""
    if "found" not in s:
        return ""
    if s["found"]:
        return (f"The search read {s['search_points']} edge sets (the curve's up to the budget of {s['max_edges']:,} "
                f"edges, then bisection): the top {s['n_top']:,} edges are the fewest it found to reach the target "
                f"faithfulness {s['faithfulness_target']:g}; pruned to the paths from the input to the logits they are "
                f"{s['n_kept']:,} edges, faithfulness {value_with_ci(s, 'faithfulness', '.3f')}.")
    return (f"The search read {s['search_points']} edge sets of at most {s['max_edges']:,} edges (the top n by "
            f"|score|): none reaches the target faithfulness {s['faithfulness_target']:g}; the best, the top "
            f"{s['n_top']:,} ({s['n_kept']:,} after pruning), recovers {value_with_ci(s, 'faithfulness', '.3f')}. "
            "So no circuit is drawn: the curve shows how many edges it would take.")


def heads_sentence(heads: pd.DataFrame, s: dict[str, Any]) -> str:
    """Which screened heads (head scores: the heads that pass their kind's test) the circuit holds."""
    if not len(heads):
        return "The head scores name no head of any kind (none passes its test), so there is no head to look for."
    what = "The circuit holds" if s.get("found", True) else "The best edge set read (not a circuit) touches"
    parts = []
    for kind, sub in heads.groupby("kind", sort=False):
        held = sub[sub["in_circuit"].astype(bool)]["site"].tolist()
        parts.append(f"{kind.replace('_', '-')} {len(held)} of {len(sub)}" + (f" ({', '.join(held)})" if held else ""))
    return f"{what} these of the heads the head scores name (a head's output with a kept edge): {'; '.join(parts)}."


def stability_sentence(s: dict[str, Any]) -> str:
    """Circuit stability in one sentence (summary keys of a Circuits run with stability > 0)."""
    if "stability_resamples" not in s:
        return ""
    what = "circuit" if s.get("found", True) else "best edge set"
    text = (f"Over {s['stability_resamples']} bootstrap resamples of the prompts the top-{s.get('n_top', s['n_kept'])} "
            f"{what} is chosen again each time: mean pairwise Jaccard {s['stability_jaccard']:.2f} (with the full-data "
            f"one {s['stability_jaccard_to_full']:.2f}); {s['n_stable']} edges are kept in at least "
            f"{s['stability_share']:.0%} of resamples (the stable circuit)")
    if "stable_faithfulness" in s:
        text += f", faithfulness {value_with_ci(s, 'stable_faithfulness', '.3f')}"
    return text + "."
