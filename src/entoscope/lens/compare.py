"""Lenses side by side: the logit, tuned and Jacobian lenses on the same prompts, layer by layer.

Per lens and layer, at each prompt's last token (END): `kl_mean`, the mean KL(model's final distribution ||
lens distribution) in nats with its bootstrap interval over prompts (the lens operation's), and `agree`,
the share of prompts whose lens top-1 token is the model's own top-1 token, with its Wilson interval
(stats/proportion.py). A lens is *informative from* layer l when, from l to the last layer, the agreement is
"most" prompts at every layer (docs/pages.md: the share >= 1/2 and its interval's lower end > 1/2; the column
`informative_from`, the same on each of the lens's rows, -1 where no layer qualifies). The takeaway is built
from claims (results/claims.py): each share and KL it states is a cell of the table.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..results.claims import Takeaway, TakeawayBuilder, most
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
        t["informative_from"] = _informative_from(t)
        t["ci_level"] = stats.ci_level
        frames.append(t)
    table = pd.concat(frames, ignore_index=True)
    return Result("lens_comparison", table, takeaway=_takeaway,
                  title="logit, tuned and Jacobian lenses side by side: agreement with the model's top token and KL")


def _informative_from(rows: pd.DataFrame) -> int:
    """The first layer from which every layer's agreement is "most" prompts (rule `most`); -1 for none."""
    rows = rows.sort_values("layer")
    passes = [most(float(r["agree"]), float(r["agree_ci_low"])) for _, r in rows.iterrows()]
    start = next((i for i in range(len(passes)) if all(passes[i:])), None)
    return -1 if start is None else int(rows["layer"].iloc[start])


def _takeaway(result: Result) -> Takeaway | str:
    """Per lens: from which layer its top token is the model's for most prompts (each layer's share quoted
    from there on) and its KL at that layer; or, where even the last layer does not qualify, its share."""
    t = result.table
    if not len(t):
        return ""
    b = TakeawayBuilder(key=("lens", "layer"))
    b.say("At each prompt's last token, the lens's top token is the model's top token for ")
    for j, (lens, rows) in enumerate(t.groupby("lens", sort=False)):
        rows = rows.sort_values("layer")
        b.say("; " if j else "")
        first = int(rows["informative_from"].iloc[0])
        if first >= 0:
            word = b.qualify(f"most prompts from layer {first} on", "most")
            b.say(f" through the {lens} lens (share: ")
            refs = []
            for k, (_, r) in enumerate(rows[rows["layer"] >= first].iterrows()):
                b.say(", " if k else "")
                refs.append(b.quote(r, "agree", name=False, after=f" at layer {int(r['layer'])}"))
            b.refer(word, refs)
            b.say("; KL(final || lens) ")
            b.quote(rows[rows["layer"] == first].iloc[0], "kl_mean", fmt=".3g", name=False,
                    after=f" nats at layer {first})")
        else:
            last = rows.iloc[-1]  # no run of layers qualifies: the last layer itself does not
            b.say("not ")
            word = b.qualify("most prompts", "not_most")
            b.say(f" even at the last layer through the {lens} lens (share: ")
            b.refer(word, [b.quote(last, "agree", name=False, after=f" at layer {int(last['layer'])})")])
    b.say(" (")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" intervals over ")
    b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    b.say(").")
    return b.build()
