"""Information flow routes' tables (circuits/ifr.py): per prompt and component, the sums the component table is
made from; the component table with its intervals over prompts; every prompt's route graph read back from the
merged per-prompt JSON; the per-prompt edge table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from .. import naming
from ..models.structure import Structure
from ..stats import Stats, interval_columns, share_interval, streamed_mean, summarise

if TYPE_CHECKING:
    from .ifr import FlowImportances, Routes


def component_stats(imp: FlowImportances, routes: Routes, last: Tensor, idx: Tensor, comp_sum: Tensor,
                    comp_edges: Tensor, comp_last: Tensor, comp_moved: Tensor) -> None:
    """Per prompt and component: summed importance and count of kept edges; importance into the last position;
    importance of the kept attention edges from an earlier token into the last position (the routes that move
    information into the prediction; 0 for an MLP, which reads its own position only)."""
    B = last.shape[0]
    b = torch.arange(B)
    kept_attn = imp.attn * routes.attn  # [L, B, T, (H,) T]
    earlier = (torch.arange(imp.attn.shape[-1])[None, :] < last[:, None]).to(imp.attn.dtype)  # [B, T]: source j < last
    if imp.granularity == "head":
        attn_sum = kept_attn.sum(dim=(2, 4)).permute(1, 0, 2)  # [B, L, H]
        attn_count = routes.attn.sum(dim=(2, 4)).permute(1, 0, 2).float()
        attn_last = imp.attn[:, b, last].sum(-1).permute(1, 0, 2)  # [B, L, H]
        attn_moved = (kept_attn[:, b, last] * earlier[None, :, None, :]).sum(-1).permute(1, 0, 2)
    else:
        attn_sum = kept_attn.sum(dim=(2, 3)).T[..., None]  # [B, L, 1]
        attn_count = routes.attn.sum(dim=(2, 3)).T[..., None].float()
        attn_last = imp.attn[:, b, last].sum(-1).T[..., None]
        attn_moved = (kept_attn[:, b, last] * earlier[None]).sum(-1).T[..., None]
    mlp_sum = (imp.mlp * routes.mlp).sum(-1).T  # [B, L]
    mlp_count = routes.mlp.sum(-1).T.float()
    mlp_last = imp.mlp[:, b, last].T
    H = attn_sum.shape[-1]
    comp_sum[idx, :, :H] = attn_sum
    comp_edges[idx, :, :H] = attn_count
    comp_last[idx, :, :H] = attn_last
    comp_moved[idx, :, :H] = attn_moved
    comp_sum[idx, :, -1] = mlp_sum
    comp_edges[idx, :, -1] = mlp_count
    comp_last[idx, :, -1] = mlp_last


def component_table(s: Structure, granularity: str, columns: Any, stats: Stats, seed: int) -> pd.DataFrame:
    """Per component: the share of prompts whose route uses it, with its Wilson score interval
    (stats/proportion.py), and its mean edges and importances (`importance_mean`: its kept edges';
    `last_position_importance_mean`: its parts of the last position's node, kept or not;
    `moved_importance_mean`: its kept attention edges from an earlier token into the last position), each with
    its bootstrap interval over prompts (one resampling for every column; `in_route_se` is the bootstrap's too),
    read block by block from the per-prompt component sums [n, layers, heads + 1]."""
    heads = s.n_heads if granularity == "head" else 1
    rows = []
    for L in range(s.n_layers):
        for h in range(heads):
            rows.append(("attention", naming.head(L, h) if granularity == "head" else naming.attention(L), L,
                         h if granularity == "head" else None, h))
        rows.append(("mlp", naming.mlp(L), L, None, s.n_heads))
    frame = pd.DataFrame({"component": [r[1] for r in rows], "kind": [r[0] for r in rows],
                          "layer": pd.array([r[2] for r in rows], dtype="Int64"),
                          "head": pd.array([r[3] for r in rows], dtype="Int64")})
    layer = np.array([r[2] for r in rows])
    col = np.array([r[4] for r in rows])

    def values(lo: int, hi: int) -> np.ndarray:  # [rows, 5 x components]
        b = columns.read(lo, hi, ["comp_sum", "comp_edges", "comp_last", "comp_moved"])
        edges = b["comp_edges"][:, layer, col]
        return np.concatenate([(edges > 0), edges, b["comp_sum"][:, layer, col], b["comp_last"][:, layer, col],
                               b["comp_moved"][:, layer, col]], axis=1).astype(np.float64)
    R = len(rows)
    names = ("in_route", "edges_mean", "importance_mean", "last_position_importance_mean", "moved_importance_mean")
    summary = summarise(streamed_mean(columns.n, len(names) * R, values, skip_nan=False), stats, seed)
    for j, name in enumerate(names):
        part = slice(j * R, (j + 1) * R)
        frame[name] = summary.value[part]
        for key, value in interval_columns(summary, name, stats).items():
            frame[key] = value[part]
    # a share of prompts: the Wilson score interval, not the bootstrap's (degenerate at 0 and n of n)
    frame["in_route_ci_low"], frame["in_route_ci_high"] = share_interval(frame["in_route"].to_numpy(), columns.n,
                                                                         stats.ci_level)
    frame["n_prompts"] = columns.n
    frame["ci_level"] = stats.ci_level
    return frame


class RouteGraphs(Sequence):
    """Every prompt's route graph (networkx), parsed from the merged per-prompt JSON when asked for."""

    def __init__(self, columns: Any) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return self.columns.n

    def __getitem__(self, i: Any) -> Any:
        import networkx as nx

        if isinstance(i, slice):
            lo, hi, _ = i.indices(len(self))
            texts = self.columns.read(lo, hi, ["graph"])["graph"] if hi > lo else []
            return [nx.node_link_graph(json.loads(t), edges="edges") for t in texts]
        i = range(len(self))[i]
        return self[i:i + 1][0]

    def __iter__(self) -> Any:
        for lo in range(0, len(self), 256):
            yield from self[lo:lo + 256]


def edge_frame(graphs: list[Any]) -> pd.DataFrame:
    records = []
    for g in graphs:
        for u, v, data in g.edges(data=True):
            records.append({"example": g.graph["example"], "component": data["component"], "kind": data["kind"],
                            "layer": data["layer"], "head": data.get("head"), "source": u, "target": v,
                            "source_position": g.nodes[u]["position"], "target_position": g.nodes[v]["position"],
                            "source_token": g.nodes[u]["token"], "target_token": g.nodes[v]["token"],
                            "importance": data["importance"], "predicted": g.graph["predicted"]})
    frame = pd.DataFrame.from_records(records, columns=[
        "example", "component", "kind", "layer", "head", "source", "target", "source_position", "target_position",
        "source_token", "target_token", "importance", "predicted"])
    frame["head"] = pd.array(frame["head"].tolist(), dtype="Int64")
    return frame
