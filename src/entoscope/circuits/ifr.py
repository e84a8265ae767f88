"""Information flow routes (Ferrando & Voita 2024, "Information Flow Routes: Automatically
Interpreting Language Models at Scale", arXiv:2403.00824), written from the paper's definitions.

Graph. One node per token position i and residual-stream state: resid_pre.0 (the embeddings), then
per layer l resid_mid.l (after attention) and resid_post.l (after the MLP); with parallel blocks
(NeoX) only resid_post.l, since attention and MLP both read resid_pre.l = resid_post.(l-1). Every
node is a sum of parts, and each part is an edge into the node:

  resid_mid.l@i  = resid_pre.l@i                                   residual edge from resid_pre.l@i
                 + sum_{h, j<=i} A^h[i, j] (v^h_j @ W_O[h])        one attention edge per head h and
                                                                   source token j, from resid_pre.l@j
                 + b_O                                             no edge (no source node)
  resid_post.l@i = resid_mid.l@i                                   residual edge
                 + mlp_out.l@i                                     MLP edge from resid_mid.l@i
  (parallel: resid_post.l@i = resid_pre.l@i + attention parts + b_O + mlp_out.l@i, the MLP edge
   coming from resid_pre.l@i.)

v^h_j is the value of token j for query head h (under grouped-query attention query head h reads
key/value head h // group; post-norms: models/post_norms.py); the value bias is in v: the parts add up exactly.
With granularity "token" the heads of one layer are summed into one attention edge per source token.

Importance (the paper's proximity, from ALTI, Ferrando et al. 2022): for a node y = sum_k z_k,
    proximity(z_k, y) = max(||y||_1 - ||y - z_k||_1, 0)
    importance(z_k, y) = proximity(z_k, y) / sum_m proximity(z_m, y)
so the importances of each node's parts (its edges and b_O) sum to one. (A node whose parts all
have zero proximity gets importance 0 everywhere; it has then no edge above any threshold.)

Routes. Top-down from the node resid_post.(L-1) at the prompt's last position (where the next
token, `predicted`, is read): at each level from the top, every edge into a node already in the
graph whose importance is ABOVE tau (strictly) is kept, and its source node joins the graph.

Work. One read-only forward per batch of prompts (no logits but the last position's). Importances
are then computed layer by layer from the top, only at the nodes the routes have reached (and at
each prompt's last position, which the component table reads at every layer), and for each node
only over its sources j <= i: the (node, source) pairs are listed flat and every head's proximity
for a pair comes from one batched tensor, with no Python loop over heads or positions.
`flow_importances` computes those of every node (the same numbers). Only the kept edges become
networkx graphs, one MultiDiGraph per prompt (parallel edges: one per head, plus residual and MLP
edges).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from .. import naming
from ..data.examples import Dataset
from ..data.tokenized import Batch, make_batches, pad_id, tokenize_data
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt
from ..metrics import readable
from ..models.adapter import ModelAdapter
from ..models.footprint import FIXED
from ..models.names import ActName
from ..models.post_norms import post_scale_reads, through_post_norm
from ..models.structure import Structure
from ..operation import Operation, Plan, Prepared, progress, register_operation
from ..results.lazy import LazyTable
from ..results.result import Result
from .ifr_table import RouteGraphs, component_stats, component_table, edge_frame
from .route_links import LinkGraph
from .takeaway import routes_takeaway

Granularity = Literal["head", "token"]


# ---------------------------------------------------------------------- importances
@dataclass
class FlowImportances:
    """Importances of every node's parts for one batch (shapes: L layers, B prompts, T positions).

    attn           [L, B, T, H, T] (head granularity) or [L, B, T, T] (token): query i, (head,) source j
    attn_residual  [L, B, T]  the residual part of the node attention writes to
    attn_bias      [L, B, T]  the b_O part of that node
    mlp            [L, B, T]  the MLP part of the node the MLP writes to (resid_post.l)
    mlp_residual   [L, B, T]  the residual part of resid_post.l (sequential); None with parallel
                              blocks, where attention and MLP write the same node
    Per node the parts sum to one: attn_residual + attn.sum(source, head) + attn_bias (+ mlp when
    parallel) for the attention node, mlp_residual + mlp for resid_post.l (sequential).
    """

    parallel: bool
    granularity: str
    attn: Tensor
    attn_residual: Tensor
    attn_bias: Tensor
    mlp: Tensor
    mlp_residual: Tensor | None


def flow_reads(structure: Structure) -> list[ActName]:
    kinds = ("resid_post", "v", "pattern", "mlp_out") + (() if structure.parallel else ("resid_mid",))
    return [ActName("resid_pre", 0)] + [a for L in range(structure.n_layers) for a in
                                        [*(ActName(k, L) for k in kinds), *post_scale_reads(structure, L, "attn")]]


def proximity(parts: Tensor, total: Tensor) -> Tensor:
    """max(||y||_1 - ||y - z||_1, 0) over the last axis; total broadcasts against parts."""
    return (total.abs().sum(-1) - (total - parts).abs().sum(-1)).clamp(min=0)


def _denominator(total: Tensor) -> Tensor:
    """The sum of a node's proximities, with 1 where it is 0 (all shares of that node are then 0)."""
    return torch.where(total > 0, total, torch.ones_like(total))


@dataclass
class _AttentionShares:
    """Shares of the parts of one layer's attention node at some nodes (zero at the others)."""

    attn: Tensor  # [B, T, H, T] or [B, T, T]
    residual: Tensor  # [B, T]
    bias: Tensor  # [B, T]
    mlp: Tensor | None  # [B, T] (parallel blocks: the MLP writes the same node)


def _attention_shares(model: ModelAdapter, acts: dict[ActName, Tensor], layer: int, nodes: Tensor,
                      granularity: str, max_floats: int, dtype: torch.dtype) -> _AttentionShares:
    """Shares of every part of the node attention writes at `layer` (resid_mid; resid_post with parallel
    blocks), at the nodes where `nodes` [B, T] is True.

    The attention parts of node (b, i) are A^h[i, j] (v^h_j @ W_O[h]) for sources j <= i only (the others
    are zero under causal attention): the (node, source) pairs are listed flat, and each pair's
    proximities for all heads come from one [pairs, H, d_model] tensor (chunked to `max_floats`)."""
    s, w = model.structure, model.weights

    def act(kind: str, L: int) -> Tensor:
        return acts[ActName(kind, L)].to(dtype)

    pre = act("resid_pre", 0) if layer == 0 else act("resid_post", layer - 1)
    node = act("resid_post" if s.parallel else "resid_mid", layer)
    B, T, d = node.shape
    H = s.n_heads
    b, i = nodes.nonzero(as_tuple=True)  # [Q] the nodes asked
    y = node[b, i]  # [Q, d]
    norm = y.abs().sum(-1)

    def closeness(part: Tensor) -> Tensor:  # proximity to y of one part per node, [Q, d] -> [Q]
        return (norm - (y - part).abs().sum(-1)).clamp(min=0)

    s1 = [acts[a].to(dtype)[b, i] for a in post_scale_reads(s, layer, "attn")]  # the post-norm's scale [Q, 1], if any
    bias = through_post_norm(model, layer, "attn", w.b_O(layer).to(dtype).expand_as(y), *s1)
    prox_res, prox_bias = closeness(pre[b, i]), closeness(bias)
    prox_mlp = closeness(act("mlp_out", layer)[b, i]) if s.parallel else None
    v = act("v", layer).repeat_interleave(s.group_size, dim=2)  # [B, T, H, d_head] per query head
    vo = torch.einsum("bkhd,hdm->bkhm", v, w.W_O(layer).to(dtype))  # [B, T, H, d]
    pattern = act("pattern", layer)  # [B, H, T, T]
    counts = i + 1  # node (b, i) has sources 0..i
    owner = torch.repeat_interleave(torch.arange(len(i), device=i.device), counts)  # [N] node of each pair
    source = torch.arange(len(owner), device=i.device) - (torch.cumsum(counts, 0) - counts)[owner]
    chunk = max(1, max_floats // (H * d))
    prox_attn = []
    for n0 in range(0, len(owner), chunk):
        o, j = owner[n0:n0 + chunk], source[n0:n0 + chunk]
        weight = pattern[b[o], :, i[o], j]  # [n, H]
        parts = through_post_norm(model, layer, "attn", weight[..., None] * vo[b[o], j], *[t[o][:, None] for t in s1])
        if granularity == "token":
            parts = parts.sum(1)  # [n, d]: the heads of the layer as one part
        target = y[o][:, None] if granularity == "head" else y[o]
        prox_attn.append((norm[o].reshape(-1, *[1] * (parts.dim() - 2))
                          - (target - parts).abs().sum(-1)).clamp(min=0))
    prox_attn_flat = torch.cat(prox_attn) if prox_attn else y.new_zeros((0, H) if granularity == "head" else (0,))
    total = prox_res + prox_bias + torch.zeros_like(norm).index_add_(
        0, owner, prox_attn_flat.reshape(len(owner), -1).sum(-1))
    if prox_mlp is not None:
        total = total + prox_mlp
    den = _denominator(total)
    attn = node.new_zeros((B, T, H, T) if granularity == "head" else (B, T, T))
    share = prox_attn_flat / den[owner].reshape(-1, *[1] * (prox_attn_flat.dim() - 1))
    if granularity == "head":
        attn[b[owner], i[owner], :, source] = share
    else:
        attn[b[owner], i[owner], source] = share

    def dense(values: Tensor) -> Tensor:
        out = node.new_zeros(B, T)
        out[b, i] = values / den
        return out
    return _AttentionShares(attn, dense(prox_res), dense(prox_bias), None if prox_mlp is None else dense(prox_mlp))


def _mlp_shares(acts: dict[ActName, Tensor], layer: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Sequential blocks: (MLP, residual) shares of resid_post.layer at every position, [B, T] each."""
    post = acts[ActName("resid_post", layer)].to(dtype)
    prox_mlp = proximity(acts[ActName("mlp_out", layer)].to(dtype), post)
    prox_res = proximity(acts[ActName("resid_mid", layer)].to(dtype), post)
    den = _denominator(prox_mlp + prox_res)
    return prox_mlp / den, prox_res / den


def _dtype(acts: dict[ActName, Tensor]) -> torch.dtype:
    """At least float32 (L1 norms of half-precision vectors lose too much)."""
    return torch.promote_types(acts[ActName("resid_pre", 0)].dtype, torch.float32)


def flow_importances(model: ModelAdapter, acts: dict[ActName, Tensor], granularity: Granularity = "head",
                     max_floats: int = 2**25) -> FlowImportances:
    """Importances of the parts of EVERY node, from the activations of `flow_reads` (one batched run).
    (`trace_routes` computes only those of the nodes its routes reach.)"""
    s = model.structure
    dtype = _dtype(acts)
    B, T = acts[ActName("resid_pre", 0)].shape[:2]
    every = torch.ones(B, T, dtype=torch.bool, device=acts[ActName("resid_pre", 0)].device)
    attn, attn_res, attn_bias, mlp, mlp_res = [], [], [], [], []
    for L in range(s.n_layers):
        shares = _attention_shares(model, acts, L, every, granularity, max_floats, dtype)
        attn.append(shares.attn)
        attn_res.append(shares.residual)
        attn_bias.append(shares.bias)
        if s.parallel:
            assert shares.mlp is not None
            mlp.append(shares.mlp)
        else:
            m, r = _mlp_shares(acts, L, dtype)
            mlp.append(m)
            mlp_res.append(r)
    return FlowImportances(s.parallel, granularity, torch.stack(attn), torch.stack(attn_res), torch.stack(attn_bias),
                           torch.stack(mlp), None if s.parallel else torch.stack(mlp_res))


# ---------------------------------------------------------------------- routes
@dataclass
class Routes:
    """Kept edges and live nodes of one batch (boolean masks, shapes as in FlowImportances).

    alive_attn_node [L, B, T]  the node attention writes to is in the graph
    alive_pre       [L, B, T]  resid_pre.l is in the graph (= resid_post.(l-1) for l > 0)
    alive_post      [L, B, T]  resid_post.l is in the graph
    """

    attn: Tensor
    attn_residual: Tensor
    mlp: Tensor
    mlp_residual: Tensor | None
    alive_attn_node: Tensor
    alive_pre: Tensor
    alive_post: Tensor


def trace_routes(model: ModelAdapter, acts: dict[ActName, Tensor], last: Tensor, tau: float,
                 granularity: Granularity = "head", max_floats: int = 2**25) -> tuple[FlowImportances, Routes]:
    """Top-down from resid_post.(L-1)@last: keep the edges above tau into nodes already in the graph.

    Importances are computed layer by layer from the top, only where they are needed: at the nodes the
    routes have reached, and at each prompt's last position (the table reads every layer there); they
    are 0 elsewhere. The kept edges equal thresholding `flow_importances` (every node) top-down."""
    s = model.structure
    dtype = _dtype(acts)
    ref = acts[ActName("resid_pre", 0)]
    B, T = ref.shape[:2]
    L, dev = s.n_layers, ref.device
    H = s.n_heads if granularity == "head" else None
    zeros = lambda *shape, kind=dtype: torch.zeros(*shape, dtype=kind, device=dev)  # noqa: E731
    attn_shape = (L, B, T, H, T) if H else (L, B, T, T)
    imp = FlowImportances(s.parallel, granularity, zeros(*attn_shape), zeros(L, B, T), zeros(L, B, T),
                          zeros(L, B, T), None if s.parallel else zeros(L, B, T))
    at_last = zeros(B, T, kind=torch.bool)
    at_last[torch.arange(B, device=dev), last.to(dev)] = True
    alive_post, alive_node, alive_pre = (zeros(L, B, T, kind=torch.bool) for _ in range(3))
    keep_attn = zeros(*attn_shape, kind=torch.bool)
    keep_res, keep_mlp = zeros(L, B, T, kind=torch.bool), zeros(L, B, T, kind=torch.bool)
    keep_mlp_res = None if s.parallel else zeros(L, B, T, kind=torch.bool)
    for layer in range(L - 1, -1, -1):
        alive_post[layer] = at_last if layer == L - 1 else alive_pre[layer + 1]
        if not s.parallel:
            assert imp.mlp_residual is not None and keep_mlp_res is not None
            m, r = _mlp_shares(acts, layer, dtype)
            asked = alive_post[layer] | at_last
            imp.mlp[layer], imp.mlp_residual[layer] = m * asked, r * asked
            keep_mlp[layer] = (m > tau) & alive_post[layer]
            keep_mlp_res[layer] = (r > tau) & alive_post[layer]
            alive_node[layer] = keep_mlp[layer] | keep_mlp_res[layer]
        else:
            alive_node[layer] = alive_post[layer]
        shares = _attention_shares(model, acts, layer, alive_node[layer] | at_last, granularity, max_floats, dtype)
        imp.attn[layer], imp.attn_residual[layer], imp.attn_bias[layer] = shares.attn, shares.residual, shares.bias
        if s.parallel:
            assert shares.mlp is not None
            imp.mlp[layer] = shares.mlp
            keep_mlp[layer] = (shares.mlp > tau) & alive_node[layer]
        live = alive_node[layer].reshape(B, T, *([1] * (shares.attn.dim() - 2)))
        keep_attn[layer] = (shares.attn > tau) & live
        keep_res[layer] = (shares.residual > tau) & alive_node[layer]
        sources = keep_attn[layer].flatten(1, -2).any(dim=1)  # [B, source]: any query (and head) kept
        alive_pre[layer] = keep_res[layer] | sources
        if s.parallel:
            alive_pre[layer] |= keep_mlp[layer]
    return imp, Routes(keep_attn, keep_res, keep_mlp, keep_mlp_res, alive_node, alive_pre, alive_post)


def node_id(state: str, layer: int, position: int) -> str:
    return naming.at(naming.activation(state, layer), position)


def _level(state: str, layer: int, parallel: bool) -> int:
    """Height of a node in drawings: resid_pre.0 at 0, then one level per residual state."""
    if state == "resid_pre":
        return 0
    if parallel:
        return layer + 1
    return 2 * layer + (1 if state == "resid_mid" else 2)


def route_graph(imp: FlowImportances, routes: Routes, b: int, tokens: list[str], meta: dict[str, Any]) -> Any:
    """The route of prompt b of the batch (kept edges and live nodes only), as the node-link data of a
    networkx MultiDiGraph (route_links.py)."""
    par = imp.parallel
    g = LinkGraph(**meta)
    L = imp.attn_residual.shape[0]
    attn_state = "resid_post" if par else "resid_mid"

    def pre(layer: int, pos: int) -> str:
        return node_id("resid_pre", 0, pos) if layer == 0 else node_id("resid_post", layer - 1, pos)

    def add_node(state: str, layer: int, pos: int) -> str:
        nid = node_id(state, layer, pos)
        if nid not in g:
            g.add_node(nid, state=state, layer=layer, position=pos, token=tokens[pos],
                       level=_level(state, layer, par))
        return nid

    def add_pre(layer: int, pos: int) -> str:
        return add_node("resid_pre", 0, pos) if layer == 0 else add_node("resid_post", layer - 1, pos)

    for layer in range(L):
        for pos in routes.alive_post[layer, b].nonzero().flatten().tolist():
            add_node("resid_post", layer, pos)
        for pos in routes.alive_attn_node[layer, b].nonzero().flatten().tolist():
            nid = add_node(attn_state, layer, pos)
            g.nodes[nid]["bias_importance"] = float(imp.attn_bias[layer, b, pos])
        for pos in routes.alive_pre[layer, b].nonzero().flatten().tolist():
            add_pre(layer, pos)
    for layer in range(L):
        for index in routes.attn[layer, b].nonzero().tolist():  # (query, head, source) or (query, source)
            q, k = index[0], index[-1]
            attrs = {"importance": float(imp.attn[layer, b][tuple(index)]), "kind": "attention", "layer": layer}
            if len(index) == 3:
                attrs.update(component=naming.head(layer, index[1]), head=index[1])
            else:
                attrs["component"] = naming.attention(layer)
            g.add_edge(pre(layer, k), node_id(attn_state, layer, q), key=attrs["component"], **attrs)
        for q in routes.attn_residual[layer, b].nonzero().flatten().tolist():
            g.add_edge(pre(layer, q), node_id(attn_state, layer, q), key="residual",
                       importance=float(imp.attn_residual[layer, b, q]), kind="residual", component="residual",
                       layer=layer)
        for q in routes.mlp[layer, b].nonzero().flatten().tolist():
            mlp_input = pre(layer, q) if par else node_id("resid_mid", layer, q)
            g.add_edge(mlp_input, node_id("resid_post", layer, q), key=f"m{layer}",
                       importance=float(imp.mlp[layer, b, q]), kind="mlp", component=f"m{layer}", layer=layer)
        if routes.mlp_residual is not None and imp.mlp_residual is not None:
            for q in routes.mlp_residual[layer, b].nonzero().flatten().tolist():
                g.add_edge(node_id("resid_mid", layer, q), node_id("resid_post", layer, q), key="residual",
                           importance=float(imp.mlp_residual[layer, b, q]), kind="residual",
                           component="residual", layer=layer)
    return g


# ---------------------------------------------------------------------- operation
@dataclass(frozen=True)
class RoutesState:
    """What IFR's prepare resolved: the batches and the attention parts computed per chunk (floats)."""

    batches: list[Batch]
    max_floats: int


@register_operation
class InformationFlowRoutes(Sharded, Operation):
    """Information flow routes (Ferrando & Voita 2024): per prompt, the graph of important edges
    from the predicted token's last-layer node down to the embeddings.

    tau:          keep edges whose importance (proximity share of their node) is above tau.
    granularity:  "head" (one attention edge per head and source token) or "token" (heads summed).
    drawn_routes: how many prompts' routes the page draws (every graph is saved).
    """

    name = "ifr"
    tau: float = Field(default=0.04, gt=0, lt=1, description="keep edges whose importance share is above tau")
    granularity: Granularity = Field(default="head", description="head: one edge per head; token: heads summed")
    drawn_routes: int = Field(default=3, ge=0, description="prompts whose routes the page draws (all are saved)")

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[RoutesState]:
        assert data is not None
        s = model.structure
        td = tokenize_data(model, data, prepend_bos=self.prepend_bos)
        T = max(td.lengths)
        H = s.n_heads if self.granularity == "head" else 1
        acts = s.n_layers * (4 * T * s.d_model + T * s.n_kv_heads * s.d_head + s.n_heads * T * T) + T * s.d_vocab
        per_example = 4 * (acts + s.n_layers * (T * H * T + 6 * T) * 2)  # the reads; importances and edge masks
        max_floats = min(2**25, max(2**20, self.budget_bytes // 32))  # attention parts per chunk; ~2 alive at once
        bs = self.choose_batch_size(per_example, len(td))
        batches = make_batches(td, bs, pad_id(model))
        notes = [f"edges kept when importance > tau = {self.tau:g}; granularity {self.granularity!r}",
                 "routes start at each prompt's last position, last layer"]
        if s.parallel:
            notes.append("parallel blocks: attention and MLP read the same node resid_pre.l")
        plan = Plan(self.name, rows=s.n_layers * (H + 1), forward_passes=len(td), backward_passes=0,
                    batch_sizes=[len(b) for b in batches], examples=len(td),
                    peak_memory_bytes=FIXED + bs * per_example + 8 * min(max_floats, bs * T * T * H * s.d_model // 2),
                    notes=notes, files=["table.csv", "table.parquet", "per_prompt.csv", "per_prompt.parquet", "index.html",
                           "graphs/*.graphml", "graphs/*.json", "manifest.json"])
        return Prepared(model, data, plan, RoutesState(batches, max_floats))

    # sharded (docs/scale.md): each shard returns its prompts' component sums and route graphs (as JSON)
    def execute_shard(self, prepared: Prepared[RoutesState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        model, st = prepared.model, prepared.state
        s = model.structure
        vocab = model.vocab_strings()
        reads = flow_reads(s)
        mine = [st.batches[i] for i in batches]
        examples = [ex for b in mine for ex in b.index]
        local = {ex: j for j, ex in enumerate(examples)}
        graphs: list[str] = [""] * len(examples)
        # per prompt, layer and component (the heads, or one attention column with granularity "token",
        # then the MLP last): summed importance of kept edges, their count, importance into the last position
        comp_sum = torch.zeros(len(examples), s.n_layers, s.n_heads + 1)
        comp_edges, comp_last, comp_moved = torch.zeros_like(comp_sum), torch.zeros_like(comp_sum), torch.zeros_like(comp_sum)
        for batch in progress(mine, total=len(mine), desc="ifr", quiet=quiet):
            with torch.no_grad():
                last = batch.last
                out = model.run(batch.tokens, reads, logits_at=last)
                imp, routes = trace_routes(model, out.acts, last, self.tau, self.granularity, st.max_floats)
                imp, routes = _to_cpu(imp), _routes_to_cpu(routes)
                predicted = out.logits.argmax(-1).cpu()
            idx = torch.tensor([local[ex] for ex in batch.index])
            component_stats(imp, routes, last, idx, comp_sum, comp_edges, comp_last, comp_moved)
            for j, ex in enumerate(batch.index):
                n = int(batch.lengths[j])
                tokens = [vocab[int(t)] for t in batch.tokens[j, :n]]
                meta = {"example": ex, "predicted": vocab[int(predicted[j])], "predicted_id": int(predicted[j]),
                        "position": n - 1, "tau": self.tau, "granularity": self.granularity,
                        "parallel": s.parallel, "n_layers": s.n_layers, "tokens": json.dumps(tokens)}
                g = route_graph(imp, routes, j, tokens, meta)
                graphs[local[ex]] = json.dumps(g.node_link_data())
        return PerPrompt(examples, {"comp_sum": comp_sum.numpy(), "comp_edges": comp_edges.numpy(),
                                    "comp_last": comp_last.numpy(), "comp_moved": comp_moved.numpy(),
                                    "graph": np.asarray(graphs, dtype=object)})

    def summarise(self, prepared: Prepared, merged: dict[str, Any], *, quiet: bool = False) -> Result:
        columns = merged["main"]
        graphs = RouteGraphs(columns)
        table = component_table(prepared.model.structure, self.granularity, columns, self.stats, self.seed)
        per_prompt = LazyTable(columns.n, lambda lo, hi: edge_frame(graphs[lo:hi]), rows_per_prompt=64)
        return RoutesResult(self.name, table, per_prompt=per_prompt, figures=self._figures,
                            title=f"information flow routes (tau {self.tau:g}): what each prompt's prediction is built "
                            "from", extra={"graphs": graphs},
                            takeaway=routes_takeaway)

    def _figures(self, result: Result) -> list[tuple[str, Any]]:
        from .ifr_figures import component_heatmap, route_figure

        figs = []
        for g in result.extra["graphs"][: self.drawn_routes]:
            name = f"route of example {g.graph['example']} (predicts {g.graph['predicted']!r})"
            figs.append((name, route_figure(g, title=name)))
        heat = component_heatmap(result.table)
        if heat is not None:
            figs.append(("fraction of prompts whose route uses each head (and MLP)", heat))
        return figs


class RoutesResult(Result):
    """An IFR result that also saves every prompt's graph as GraphML and JSON (graphs/)."""

    def save_extra(self, folder: Path, files: list[str]) -> None:
        import networkx as nx

        out = folder / "graphs"
        out.mkdir(exist_ok=True)
        for g in self.extra["graphs"]:
            stem = f"example_{g.graph['example']}"
            nx.write_graphml(g, out / f"{stem}.graphml")
            data = nx.node_link_data(g, edges="edges")
            (out / f"{stem}.json").write_text(json.dumps(data, default=str), encoding="utf-8")
            files += [f"graphs/{stem}.graphml", f"graphs/{stem}.json"]


def _to_cpu(imp: FlowImportances) -> FlowImportances:
    return replace(imp, **{f: None if getattr(imp, f) is None else readable(getattr(imp, f).detach()).cpu()
                           for f in ("attn", "attn_residual", "attn_bias", "mlp", "mlp_residual")})


def _routes_to_cpu(routes: Routes) -> Routes:
    return Routes(**{f: None if getattr(routes, f) is None else getattr(routes, f).cpu()
                     for f in routes.__dataclass_fields__})
