"""Lenses side by side: the logit, tuned and Jacobian lenses on the same prompts, layer by layer.

Per lens and layer, at each prompt's last token (END): `kl_mean`, the mean KL(model's final distribution ||
lens distribution) in nats with its bootstrap interval over prompts (the lens operation's), and `agree`,
the share of prompts whose lens top-1 token is the model's own top-1 token, with its Wilson interval
(stats/proportion.py). A lens is *informative from* layer l when, from l to the last layer, the agreement's
interval lies above 1/2 at every layer (the column `informative_from`, the same on each of the lens's rows).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..results.result import Result
from ..sites import Sites
from ..stats import Stats
from ..stats.proportion import share_interval
from .operation import Lens


def compare_lenses(model: Any, data: Any, *, translators: str | None = None, jacobian: str | None = None,
                   layers: Any = "all", stats: Stats | None = None, seed: int = 0, quiet: bool = True) -> Result:
    """Run the logit lens, and the tuned (`translators`) and Jacobian (`jacobian`) lenses where given, on the
    same prompts' last tokens; one row per lens and layer (see the module docstring)."""
    stats = stats or Stats()
    methods = [("logit", {})] + ([("tuned", {"translators": translators})] if translators else []) + \
        ([("jacobian", {"lens": jacobian})] if jacobian else [])
    frames = []
    for method, kw in methods:
        sites = Sites(activation="resid_post", over=["layer"], layers=layers)
        r = Lens(method=method, sites=sites, top_k=1, stats=stats, seed=seed, **kw).run(model, data, quiet=quiet)
        pp = r.per_prompt
        last = pp["layer"].max()
        model_top = pp[pp["layer"] == last].set_index("example")["top1_token"]  # the last layer decodes the logits
        pp = pp.assign(agree=(pp["top1_token"].to_numpy() == model_top.reindex(pp["example"]).to_numpy()))
        share = pp.groupby("layer")["agree"].agg(["mean", "count"])
        t = r.table[["layer", "n_prompts", "kl_mean", "kl_mean_ci_low", "kl_mean_ci_high"]].copy()
        t.insert(0, "lens", method)
        t["agree"] = share["mean"].reindex(t["layer"]).to_numpy()
        low, high = share_interval(t["agree"].to_numpy(), share["count"].reindex(t["layer"]).to_numpy(), stats.ci_level)
        t["agree_ci_low"], t["agree_ci_high"] = low, high
        above = (t.sort_values("layer")["agree_ci_low"] > 0.5).to_numpy()[::-1]
        run = int(np.argmin(above)) if not above.all() else len(above)  # layers above 1/2 counted from the last
        order = t.sort_values("layer")["layer"].to_numpy()
        t["informative_from"] = int(order[len(order) - run]) if run else -1
        t["ci_level"] = stats.ci_level
        frames.append(t)
    table = pd.concat(frames, ignore_index=True)
    return Result("lens_comparison", table, takeaway=_takeaway,
                  title="logit, tuned and Jacobian lenses side by side: agreement with the model's top token and KL")


def _takeaway(result: Result) -> str:
    t = result.table
    parts = []
    for lens, rows in t.groupby("lens", sort=False):
        first = int(rows["informative_from"].iloc[0])
        parts.append(f"the {lens} lens from layer {first}" if first >= 0 else f"the {lens} lens at no layer")
    n = int(t["n_prompts"].max())
    level = int(round(float(t["ci_level"].iloc[0]) * 100))
    return (f"Over {n} prompts' last tokens, the lens's top token is the model's for more than half of the prompts "
            f"(the {level}% interval above 1/2) at every layer from there on for " + ", ".join(parts) + ".")
