"""`InspectResult`: what `es.inspect` returns. A Result whose `table` is the predictions (one row per position)
and whose `tables` hold the other views (lens, the tuned or Jacobian lens, attention, dla, patching), each
also an attribute; its page and its notebook view draw them all (page.py)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..results.result import Result
from .takeaway import inspect_takeaway

BLANK = "the answer and wrong-answer columns are read at the last position only"


class InspectResult(Result):
    """One prompt inspected: `.table` (= `.predictions`), `.lens`, `.attention`, `.dla`, `.patching` (None where
    not computed), `.tables` (all of them by name), `.tokens`; `save(folder)` writes each table and the page."""

    def __init__(self, operation: str, table: pd.DataFrame, *, tables: dict[str, pd.DataFrame], extra: dict[str, Any],
                 title: str, structure: Any) -> None:
        from .figures import dla_figures, metric_label, patching_figure

        def figures(result: Result) -> list[tuple[str, Any]]:
            figs = []
            if result.tables.get("dla") is not None:
                terms = result.extra["dla_terms"]
                figs += dla_figures(result.tables["dla"], metric_label(terms["metric"], result.extra["answer"],
                                                                       result.extra["wrong"]))
            if result.tables.get("patching") is not None:
                terms = result.extra["patching_terms"]
                figs.append(patching_figure(result.tables["patching"],
                                            metric_label(terms["metric"], terms["answer"], terms["wrong"])))
            return figs

        super().__init__(operation, table, figures=figures, title=title, extra=extra, takeaway=inspect_takeaway,
                         blank_note=BLANK)
        self.tables = tables
        self.extra["structure"] = {"n_layers": structure.n_layers, "n_heads": structure.n_heads,
                                   "architecture": structure.architecture}

    @property
    def predictions(self) -> pd.DataFrame:
        """The model's top next tokens at each position (the main table)."""
        return self.table

    @property
    def lens(self) -> pd.DataFrame:
        """The logit lens grid: one row per (layer, position)."""
        return self.tables["lens"]

    @property
    def attention(self) -> pd.DataFrame:
        """Every head's attention: one row per (layer, head, query position, key position <= query)."""
        return self.tables["attention"]

    @property
    def dla(self) -> pd.DataFrame | None:
        """The direct logit attribution at the last position (with an answer), its rows summing to the metric."""
        return self.tables.get("dla")

    @property
    def patching(self) -> pd.DataFrame | None:
        """Exact patching of resid_pre over layer x position (with a counterfactual)."""
        return self.tables.get("patching")

    @property
    def tokens(self) -> list[str]:
        """The prompt's tokens, as text."""
        return [str(t) for t in self.table["token"]]

    def page_sections(self) -> list[tuple[str, str]]:
        from .page import page_sections

        return page_sections(self)

    def _repr_html_(self) -> str:
        from .page import notebook_view

        return notebook_view(self)
