"""Statistics of attribution graphs over prompts (dictionaries/graph.py): the dataset's graph, intervals of
its nodes' attributions and of its replacement and completeness scores, by the bootstrap over prompts.

The dataset's graph is the mean over prompts of each prompt's graph with positions summed into one node
per (site, feature), one error node per site, one token node (`input`) and the metric: its edges keep
their signs until the mean is taken, and the scores (Ameisen et al. 2025) are computed on the mean graph,
so they are not the mean of the prompts' scores. Resampling the prompts (stats/, multinomial counts W)
gives the weighted mean graph sum_i w_i M_i / sum_i w_i and its scores: the interval of the dataset's
scores. Node attributions are means over prompts (0 where a prompt's graph does not hold the node).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from ..stats import FunctionStat, Stats, interval_columns, mean_stat, summarise

KIND_ORDER = {"feature": 0, "error": 1, "token": 2, "metric": 3}
MAX_STACK_FLOATS = 1 << 25  # prompts x nodes^2 held for the dataset scores' interval (256 MiB of float64)
RESAMPLES_AT_ONCE = 50


def node_key(row: Any) -> str:
    """A per-prompt node's node in the dataset's graph (positions summed)."""
    if row.kind == "feature":
        return f"{row.site}.f{row.feature}"
    if row.kind == "error":
        return f"{row.site}.error"
    return "input" if row.kind == "token" else "metric"


def stacked(graphs: list[Any]) -> tuple[pd.DataFrame, list[torch.Tensor], np.ndarray]:
    """(the dataset graph's nodes, each prompt's collapsed adjacency [N, N], each prompt's node
    attributions [n, N] with 0 where the prompt has no such node)."""
    info: dict[str, dict[str, Any]] = {}
    for g in graphs:
        for row in g.nodes.itertuples():
            info.setdefault(node_key(row), {"kind": row.kind, "site": row.site, "layer": row.layer,
                                            "dictionary": row.dictionary, "feature": row.feature})

    def order_key(n: str) -> tuple[int, int, str]:
        layer = info[n]["layer"]
        return KIND_ORDER[info[n]["kind"]], -1 if layer is pd.NA or layer is None else int(layer), n
    order = sorted(info, key=order_key)
    index = {n: i for i, n in enumerate(order)}
    N = len(order)
    mats, attribution = [], np.zeros((len(graphs), N))
    for p, g in enumerate(graphs):
        ids = torch.tensor([index[node_key(r)] for r in g.nodes.itertuples()])
        M = torch.zeros(N, len(g.nodes), dtype=torch.float64).index_add_(0, ids, g.adjacency.double())
        M = torch.zeros(N, N, dtype=torch.float64).index_add_(1, ids, M)
        M.fill_diagonal_(0.0)  # a collapsed node's edges between its own positions are not a loop
        mats.append(M)
        np.add.at(attribution[p], ids.numpy(), np.nan_to_num(g.nodes["attribution"].to_numpy(dtype=float)))
    nodes = pd.DataFrame([{"node": n, **info[n]} for n in order])
    present = np.zeros(N)
    for g in graphs:
        np.add.at(present, np.unique([index[node_key(r)] for r in g.nodes.itertuples()]), 1)
    nodes["prompts"] = present.astype(int)
    return nodes, mats, attribution


def batched_scores(A: torch.Tensor, kinds: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Replacement and completeness of K graphs at once (A [K, N, N], rows targets): graph.graph_scores,
    batched (Â row-normalised |A|; influence I = w (Â + Â^2 + ...); see dictionaries/graph.py)."""
    a = A.abs()
    A_norm = a / a.sum(2, keepdim=True).clamp(min=1e-12)
    w = torch.tensor(kinds == "metric", dtype=torch.float64)
    current = (w @ A_norm)  # [K, N]
    total = current.clone()
    for _ in range(A.shape[1]):
        if not bool(current.any()):
            break
        current = torch.bmm(current[:, None, :], A_norm)[:, 0]
        total += current
    errors, tokens = torch.tensor(kinds == "error"), torch.tensor(kinds == "token")
    tok, err = total[:, tokens].sum(1), total[:, errors].sum(1)
    out = total + w
    non_error = 1 - A_norm[:, :, errors].sum(2)
    replacement = torch.where(tok + err > 0, tok / (tok + err).clamp(min=1e-300), torch.full_like(tok, float("nan")))
    return replacement, (non_error * out).sum(1) / out.sum(1)


def dataset_score_summary(mats: list[torch.Tensor], kinds: np.ndarray, stats: Stats, seed: int) -> Any | None:
    """The bootstrap summary (replacement, completeness) of the dataset's mean graph over resampled
    prompts; None where the prompts' graphs are too large to hold together (MAX_STACK_FLOATS)."""
    n, N = len(mats), (mats[0].shape[0] if mats else 0)
    if not n or n * N * N > MAX_STACK_FLOATS:
        return None
    stack = torch.stack(mats).reshape(n, N * N)

    def fn(W: np.ndarray, cols: slice = slice(None)) -> np.ndarray:
        out = np.empty((W.shape[0], 2))
        for k0 in range(0, W.shape[0], RESAMPLES_AT_ONCE):
            w = torch.from_numpy(np.asarray(W[k0:k0 + RESAMPLES_AT_ONCE], dtype=np.float64))
            A = (w @ stack / w.sum(1, keepdim=True)).reshape(-1, N, N)
            r, c = batched_scores(A, kinds)
            out[k0:k0 + len(w)] = torch.stack([r, c], 1).numpy()
        return out[:, cols]
    return summarise(FunctionStat(fn, n, 2), stats, seed)


def score_table(graphs: list[Any], per_prompt: pd.DataFrame, mats: list[torch.Tensor], kinds: np.ndarray,
                stats: Stats, seed: int) -> pd.DataFrame:
    """scores.csv: each prompt's replacement and completeness; `mean of prompts` (their mean, with its
    interval); `dataset` (the mean graph's scores, with the interval over resampled prompts);
    `dataset, |edges|` (the mean of the absolute edges' graph: what the signs' cancelling changes)."""
    rows = per_prompt.assign(example=per_prompt["example"].astype(str))
    values = per_prompt[["replacement", "completeness"]].to_numpy(dtype=float)
    mean = summarise(mean_stat(values), stats, seed)
    extra = [{"example": "mean of prompts", "replacement": mean.value[0], "completeness": mean.value[1],
              **{k: v[0] for k, v in interval_columns(mean, "replacement", stats).items()},
              **{k: v[1] for k, v in interval_columns(mean, "completeness", stats).items()}}]
    A = torch.stack(mats).mean(0)[None]
    r, c = batched_scores(A, kinds)
    whole = {"example": "dataset", "replacement": float(r[0]), "completeness": float(c[0])}
    s = dataset_score_summary(mats, kinds, stats, seed)
    if s is not None:
        whole.update({k: v[0] for k, v in interval_columns(s, "replacement", stats).items()})
        whole.update({k: v[1] for k, v in interval_columns(s, "completeness", stats).items()})
    extra.append(whole)
    r_abs, c_abs = batched_scores(torch.stack([m.abs() for m in mats]).mean(0)[None], kinds)
    extra.append({"example": "dataset, |edges|", "replacement": float(r_abs[0]), "completeness": float(c_abs[0])})
    table = pd.concat([rows, pd.DataFrame(extra)], ignore_index=True)
    table["n_prompts"] = len(graphs)
    table["ci_level"] = stats.ci_level
    return table


def attribution_columns(attribution: np.ndarray, stats: Stats, seed: int) -> dict[str, Any]:
    """Each dataset node's mean attribution over prompts with its interval (columns attribution_*)."""
    s = summarise(mean_stat(attribution), stats, seed)
    cols = {"attribution": s.value}
    cols.update({k: v for k, v in interval_columns(s, "attribution", stats).items() if not k.endswith("_se")})
    return cols
