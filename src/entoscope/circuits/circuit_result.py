"""What a circuits run returns: `CircuitResult` (the table, the circuit, its summary, the faithfulness curve and the
search's points, ACDC's decisions) and its figures: the circuit's drawing, and the curve with the circuit chosen
(or, where the target search found none, the curve alone: no drawing of a circuit that recovers too little)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from ..results.page import figure_div, write_page
from ..results.result import Result
from .figures import circuit_figure, faithfulness_figure
from .graph import Circuit, Node
from .takeaway import sign_labels


class CircuitResult(Result):
    """A Result that also saves the circuit (MIB JSON, GraphML, its drawing), the summary, the
    faithfulness curve and ACDC's decisions."""

    @property
    def circuit(self) -> Circuit:
        return self.extra["circuit"]

    @property
    def summary(self) -> dict[str, Any]:
        return self.extra["summary"]

    def drawing(self) -> tuple[str, Any]:
        """(title, the circuit's drawing), drawn once: the page, circuit.html and a report show the same one."""
        if getattr(self, "_drawing", None) is None:
            circuit, s = self.circuit, self.summary
            title = f"circuit: {circuit.n_kept} of {circuit.graph.n_edges} edges"
            if s.get("found") is False:
                title = (f"no circuit found: the best edge set read, {circuit.n_kept} of {circuit.graph.n_edges} edges "
                         f"(below the target {s['faithfulness_target']:g})")
            if "faithfulness" in s:
                title += f", faithfulness {s['faithfulness']:.3f}"
            self._drawing = (title, circuit_figure(circuit, title=title, node_stats=self.extra.get("node_stats"),
                                                   sign_labels=sign_labels(s["method"]), edge_rows=_edge_rows(self),
                                                   level=float(s.get("ci_level", 0.95))))
        return self._drawing

    def save_extra(self, folder: Path, files: list[str]) -> None:
        self.circuit.save_json(folder / "circuit.json")
        # the circuit's own nodes and edges (every scored edge is in circuit.json and the table: a real model's
        # graph of 70,000 edges takes networkx seconds to write and a graph viewer minutes to open)
        self.circuit.save_graphml(folder / "circuit.graphml", only_kept=True)
        nodes = self.extra.get("node_stats")
        if nodes:  # the senders' summed scores the drawing's hover quotes
            pd.DataFrame([{"node": n, "kind": Node.parse(n).kind, "summed_score": v, "summed_score_ci_low": lo,
                           "summed_score_ci_high": hi, "ci_level": self.summary.get("ci_level", 0.95)}
                          for n, (v, lo, hi) in nodes.items()]).to_csv(folder / "nodes.csv", index=False)
            files.append("nodes.csv")
        if self.summary.get("found") is False:  # no circuit to draw (and a best set of thousands of edges is slow to)
            note = ("<p>No circuit reached the target faithfulness within the budget; circuit.json holds the best "
                    "edge set read. The faithfulness curve:</p>")
            sections = [("no circuit found", note + "".join(figure_div(f) for _, f in _figures(self)))]
        else:
            sections = [("circuit", figure_div(self.drawing()[1]))]
        write_page(folder / "circuit.html", self.title, sections, js_relpath=self.js_relpath, back=self.back_relpath)
        (folder / "summary.json").write_text(json.dumps(self.summary, indent=2, default=float), encoding="utf-8")
        files += ["circuit.json", "circuit.graphml", "circuit.html", "summary.json"]
        if self.extra.get("curve") is not None:
            self.extra["curve"].to_csv(folder / "faithfulness.csv", index=False)
            files.append("faithfulness.csv")
        if self.extra.get("search") is not None:
            self.extra["search"].to_csv(folder / "search.csv", index=False)
            files.append("search.csv")
        if self.extra.get("decisions") is not None:
            self.extra["decisions"].to_csv(folder / "acdc_decisions.csv", index=False)
            files.append("acdc_decisions.csv")


def _edge_rows(result: Result) -> dict[str, dict[str, Any]]:
    """The kept edges' table rows (what the drawing's hover quotes)."""
    t = result.table
    if "edge" not in t or "score" not in t:
        return {}
    cols = [c for c in ("edge", "score", "score_ci_low", "score_ci_high", "ci_level") if c in t]
    kept = t[t["in_circuit"].astype(bool)] if "in_circuit" in t else t
    return {r["edge"]: r for r in kept[cols].to_dict("records")}


def _figures(result: Result) -> list[tuple[str, Any]]:
    """The circuit's drawing, then the faithfulness curve; where the target search found no circuit, the curve (and
    the points the search read) alone: a drawing would show edges that recover too little as if they were one."""
    assert isinstance(result, CircuitResult)
    s = result.summary
    figs = [] if s.get("found") is False else [result.drawing()]
    curve, search = result.extra.get("curve"), result.extra.get("search")
    star = "the circuit found" if s.get("found") else "the best edge set read" if "found" in s else "the chosen circuit"
    if curve is not None and len(curve):
        figs.append((f"faithfulness curve (CPR {s['cpr']:.3f}, CMD {s['cmd']:.3f}; the star: {star})",
                     faithfulness_figure(curve, s, search)))
    elif search is not None and len(search):
        figs.append((f"faithfulness of the edge sets the search read (the star: {star})",
                     faithfulness_figure(curve, s, search)))
    return figs
