"""Attribution graphs over dictionary features: features, error nodes, input tokens and the metric as nodes.

For one prompt, with dictionaries D_1..D_n at sites in layer order (the demo's resid_post SAEs, or its
transcoders standing in for the MLPs), the nodes are
    feature  (site l, position p, feature i), value f = D_l.encode(x_in)
    error    (site l, position p), value e = x_out - D_l.decode(f)      (a d_model vector)
    token    (position p), value the embeddings entering block 0 (resid_pre.0)
    metric   the logit difference (or logit) at the last position.
**Direct effects.** In the graph's forward every site writes `decode(f_leaf) + e_leaf`, leaves holding
the node values, so what a site computes downstream depends on the nodes upstream only through those
leaves (attention, norms and the MLPs without a dictionary stay the model's own, differentiated as they
are). The edge from source u to target t is

    A[t, u] = (u - u_base) . d t / d u_leaf                                         (EAP)
    A[t, u] = (u - u_base) . mean_k d t / d u_leaf  at  leaves = base + alpha_k (u - base)   (EAP-IG)

with t a feature's encoding `D_l.encode(x_in)` (the target's own value, not weighted by the metric) or
the metric; u_base is the counterfactual prompt's value (`baseline: counterfactual`, the pairs of
patching) or zero (`baseline: zero`: a single prompt's contributions, as in circuit tracing). A[t, u] is
the first-order change of t when u moves from its baseline to its value with every other node held:
positive supports t. (circuits/eap.py scores the opposite move, clean to corrupt, so its signs are
flipped relative to these.) EAP-IG (midpoint rule over `steps` points) along the straight path of all
nodes at once satisfies completeness for each target: the sum of its incoming edges from all sources
(kept or not) tends to t(clean) - t(base) (`incoming_sum` vs `target_change` in the node table).

Each target needs its own gradient: the prompt is repeated along the batch, one copy per target (the
kept features and the metric), and one backward pass gives every copy's gradient at once.

**Which features.** A first backward with the model's own gradient paths (each site written as
x_out + (f_leaf - f) W_dec + (e_leaf - e), exactly x_out) gives every node's total effect on the metric,
`attribution` = (u - u_base) . dm/du (attribution patching, Marks et al. 2024, "Sparse feature circuits");
the `max_features` features of largest |attribution| per prompt are the graph's feature nodes (every
error and token node is kept). Edges from features left out are dropped, as in circuit tracing.

**Scores** (Ameisen et al. 2025, "Circuit tracing: revealing computational graphs in language models",
transformer-circuits.pub; as circuit-tracer computes them): with Â the row-normalised |A| (each target's
incoming |edges| sum to one) and w the output weights (1 on the metric node), node influence
I = w (Â + Â^2 + ...);
    replacement  = I(tokens) / (I(tokens) + I(errors)): the share of end-to-end influence from the inputs
                   that reaches the metric through features rather than through error nodes;
    completeness = sum_n (1 - sum_{errors e} Â[n, e]) (I_n + w_n) / sum_n (I_n + w_n): the share of each
                   node's incoming attribution from non-error nodes, weighted by its influence.
circuit-tracer's output nodes are the top logits weighted by probability; here the one metric node.

**A dataset's graph**: every prompt's adjacency with positions summed into one node per (site, feature),
one error node per site and one token node, averaged over prompts (Marks et al. sum over positions too);
scores on it, and each prompt's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field
from torch import Tensor

from .. import naming
from ..data.examples import Dataset
from ..data.tokenized import Batch, make_batches, pad_id, tokenize_data
from ..errors import ConfigError, DataError
from ..metrics import at_positions
from ..metrics import logit as logit_metric
from ..metrics import logit_diff as logit_diff_metric
from ..models.adapter import Intervention, ModelAdapter
from ..models.names import ActName, parse_name
from ..operation import (
    Operation,
    Plan,
    Prepared,
    progress,
    register_operation,
)
from ..results.result import Result
from ..sites import Selection, Sites
from ..models.dictionaries.catalog import get_dictionary
from ..models.dictionaries.dictionary import Dictionary
from .graph_page import READING, graph_figures, graph_takeaway
from .graph_stats import attribution_columns, score_table, stacked

EMBED = ActName("resid_pre", 0)


@dataclass
class Site:
    """One dictionary of the graph: where it reads and writes."""

    layer: int
    key: str
    d: Dictionary
    hook_in: ActName
    hook_out: ActName

    @property
    def name(self) -> str:
        """The site's name in the naming scheme (resid_post.1; a transcoder's mlp_out.1: m1)."""
        return naming.activation(self.hook_out.kind, self.hook_out.layer)


@dataclass
class AttributionGraph:
    """One attribution graph. Nodes in order: features, errors (site-major), tokens, the metric.

    nodes: one row per node (kind, layer, dictionary, position, feature, value, attribution, influence,
           incoming_sum, target_change); adjacency [N, N]: rows are targets, columns sources."""

    nodes: pd.DataFrame
    adjacency: Tensor

    @property
    def kinds(self) -> np.ndarray:
        return self.nodes["kind"].to_numpy()

    def scores(self) -> dict[str, float]:
        """Replacement and completeness (Ameisen et al. 2025), with the metric as the one output node."""
        return graph_scores(self.adjacency, self.kinds)

    def edges(self, top: int | None = None) -> pd.DataFrame:
        """Edges by |weight| (all, or the `top` strongest): source, target, weight."""
        A = self.adjacency
        idx = A.abs().flatten().argsort(descending=True)
        idx = idx[A.abs().flatten()[idx] > 0]
        if top is not None:
            idx = idx[:top]
        t, s = idx // A.shape[1], idx % A.shape[1]
        names = self.nodes["node"].to_numpy()
        return pd.DataFrame({"source": names[s.numpy()], "target": names[t.numpy()],
                             "weight": A[t, s].numpy()})


def normalize(A: Tensor) -> Tensor:
    """|A| with each row (a target's incoming edges) summing to one (rows without edges stay zero)."""
    a = A.abs()
    return a / a.sum(1, keepdim=True).clamp(min=1e-12)


def influence(A_norm: Tensor, weights: Tensor) -> Tensor:
    """w (Â + Â^2 + ...): each node's influence on the outputs (a DAG: the powers vanish)."""
    current = weights @ A_norm
    total = current.clone()
    for _ in range(A_norm.shape[0]):
        if not bool(current.any()):
            break
        current = current @ A_norm
        total += current
    return total


def graph_scores(A: Tensor, kinds: np.ndarray) -> dict[str, float]:
    A_norm = normalize(A.double())
    w = torch.tensor(kinds == "metric", dtype=torch.float64)
    inf = influence(A_norm, w)
    errors, tokens = torch.tensor(kinds == "error"), torch.tensor(kinds == "token")
    tok, err = float(inf[tokens].sum()), float(inf[errors].sum())
    out = inf + w
    non_error = 1 - A_norm[:, errors].sum(1)
    return {"replacement": tok / (tok + err) if tok + err > 0 else float("nan"),
            "completeness": float((non_error * out).sum() / out.sum())}


def node_influence(A: Tensor, kinds: np.ndarray) -> Tensor:
    w = torch.tensor(kinds == "metric", dtype=torch.float64)
    return influence(normalize(A.double()), w)


@dataclass(frozen=True)
class FeatureGraphState:
    """What feature_graph's prepare resolved: its dictionary sites and one-prompt batches."""

    sites: list[Site]
    batches: list[Batch]
    n: int  # prompts


@register_operation
class FeatureGraph(Operation):
    """An attribution graph over dictionary features and error nodes, per prompt and for the dataset.

    dictionary, activation, layers: the dictionary sites, as Sites(activation=..., dictionary=..., layers=...)
                  (resid_post with the demo release: an SAE per layer; mlp_out: the transcoders).
    method:       eap (gradients at the prompt) or eap_ig (midpoint rule over `steps` points).
    baseline:     counterfactual (each prompt's pair, same token length) or zero.
    max_features: feature nodes per prompt (largest |attribution| on the metric).
    metric:       logit_diff (answers minus wrong answers) or logit, at the last position.
    """

    name = "feature_graph"
    dictionary: str = Field(default="demo", description="the dictionary release (demo: the bundled ones), as in "
                            "Sites(dictionary=...)")
    activation: str = Field(default="resid_post", description="the site the dictionaries read and write: resid_post "
                            "(an SAE per layer) or mlp_out (transcoders)")
    layers: Selection = Field(default="all", description="which layers' dictionaries (all: every layer the release "
                              "covers)")
    method: Literal["eap", "eap_ig"] = Field(default="eap", description="eap (gradients at the prompt) or eap_ig "
                                             "(midpoint rule over steps points)")
    steps: int = Field(default=8, ge=1, description="eap_ig: points of the midpoint rule")
    baseline: Literal["counterfactual", "zero"] = Field(default="counterfactual", description="counterfactual (each "
                                                        "prompt's pair, same token length) or zero")
    max_features: int = Field(default=32, ge=1, description="feature nodes per prompt (largest |attribution| on the "
                              "metric)")
    metric: Literal["logit_diff", "logit"] = Field(default="logit_diff", description="logit_diff (answers minus "
                                                   "wrong answers) or logit, at the last position")

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[FeatureGraphState]:
        assert data is not None
        siteset = Sites(activation=self.activation, dictionary=self.dictionary, layers=self.layers,
                        over=["layer"]).resolve(model)
        sites = []
        for L, key in siteset.bases:
            d = get_dictionary(key)
            sites.append(Site(L, key, d, model.resolve(parse_name(d.hook_in)), model.resolve(parse_name(d.hook_out))))
        if any(s.hook_in == EMBED or s.hook_out == EMBED for s in sites):
            raise ConfigError("a dictionary on resid_pre.0 would share the token nodes' site", code="config_invalid",
                              remedy="use dictionaries on later sites")
        td = tokenize_data(model, data, prepend_bos=self.prepend_bos, pairs=self.baseline == "counterfactual",
                           answers=True)
        if self.metric == "logit_diff" and any(not w for w in td.wrong_answers or []):
            raise DataError("some examples have no wrong answer, so the logit difference is undefined",
                            code="metric_needs_answers", remedy="give wrong_answers, or use metric: logit")
        batches = make_batches(td, 1, pad_id(model))  # one prompt per pass: the batch holds its copies
        s = model.structure
        T = max(td.lengths)
        K = self.max_features + 1
        points = self.steps if self.method == "eap_ig" else 1
        per_pass = 4 * K * T * (len(sites) * (s.d_model * 4 + 2 * sites[0].d.d_sae) + s.n_layers * 8 * s.d_model
                                + s.d_vocab)
        # the dataset graph's nodes: each feature kept in some prompt, each dictionary's error, tokens, metric
        rows = min(len(td) * self.max_features, sum(x.d.d_sae for x in sites)) + len(sites) + 2
        # per prompt: its node values, its baseline's (counterfactual), one run for the total gradients, then at
        # each point one run of K copies (a copy per target feature, the last for the metric), each with a backward
        cf = int(self.baseline == "counterfactual")
        plan = Plan(self.name, rows=rows, forward_passes=len(td) * (2 + cf + points * K),
                    backward_passes=len(td) * (1 + points * K),
                    batch_sizes=[K] * len(td), examples=len(td), peak_memory_bytes=per_pass,
                    notes=[f"sites: {', '.join(f'{x.hook_out} <- {x.key}' for x in sites)}",
                           f"{self.method}, baseline {self.baseline}; {self.max_features} feature nodes per prompt",
                           "rows: at most (the features kept in some prompt, one node per dictionary's error, "
                           "the tokens and the metric); forward and backward passes: at most (a prompt with fewer "
                           "active features runs fewer copies)"],
                    files=["table.csv", "per_prompt.csv", "edges.csv", "scores.csv", "index.html", "manifest.json"])
        return Prepared(model, data, plan, FeatureGraphState(sites, batches, len(td)))

    def execute(self, prepared: Prepared[FeatureGraphState], *, quiet: bool = False) -> Result:
        model, st = prepared.model, prepared.state
        graphs: list[AttributionGraph] = [None] * st.n  # type: ignore[list-item]
        for batch in progress(st.batches, total=len(st.batches), desc="feature graph", quiet=quiet):
            graphs[batch.index[0]] = self.graph(model, st.sites, batch)
        nodes, mats, attribution = stacked(graphs)
        dataset = _dataset_graph(nodes, mats, attribution)
        scores = pd.DataFrame([{"example": i, **g.scores()} for i, g in enumerate(graphs)])
        whole = dataset.scores()
        per_prompt = pd.concat([g.nodes.assign(example=i) for i, g in enumerate(graphs)], ignore_index=True)
        per_prompt.insert(0, "example", per_prompt.pop("example"))
        table = dataset.nodes.assign(**attribution_columns(attribution, self.stats, self.seed))
        table["n_prompts"], table["ci_level"] = len(graphs), self.stats.ci_level
        table = table.sort_values("attribution", key=abs, ascending=False, kind="stable").reset_index(drop=True)
        score_rows = score_table(graphs, scores, mats, dataset.kinds, self.stats, self.seed)
        result = GraphResult(self.name, table, per_prompt=per_prompt, figures=graph_figures, takeaway=graph_takeaway,
                           title=f"attribution graph over {self.activation} features ({self.method}, {self.metric})",
                           extra={"graphs": graphs, "dataset": dataset, "scores": scores, "dataset_scores": whole,
                                  "score_table": score_rows})
        result.notes = [("reading the graph", READING)]
        return result

    # ------------------------------------------------------------------ one prompt
    def graph(self, model: ModelAdapter, sites: list[Site], batch: Batch) -> AttributionGraph:
        clean = _node_values(model, sites, batch.tokens)
        if self.baseline == "counterfactual":
            assert batch.cf_tokens is not None
            base = _node_values(model, sites, batch.cf_tokens)
        else:
            base = {k: torch.zeros_like(v) for k, v in clean.items()}
        delta = {k: clean[k] - base[k] for k in clean}
        metric = self._metric(batch)
        total = self._total_gradients(model, sites, batch, clean, metric)
        attribution = {k: (delta[k] * total[k]).sum(-1) if k[0] != "f" else delta[k] * total[k] for k in delta}
        chosen = _top_features(sites, attribution, self.max_features)
        targets = [(s, p, i) for s, p, i in chosen]
        alphas = [(k + 0.5) / self.steps for k in range(self.steps)] if self.method == "eap_ig" else [1.0]
        grads = {k: torch.zeros((len(targets) + 1,) + v.shape, dtype=torch.float64) for k, v in clean.items()}
        for alpha in alphas:
            point = {k: base[k] + alpha * delta[k] for k in clean}
            for k, g in self._direct_gradients(model, sites, batch, point, targets, metric).items():
                grads[k] += g / len(alphas)
        edges = {k: (grads[k] * delta[k].double()).sum(-1) if k[0] != "f" else grads[k] * delta[k].double()
                 for k in grads}  # per target: [K, T] (errors, tokens) or [K, T, F] (features)
        return _assemble(model, sites, batch, clean, base, attribution, chosen, edges, metric)

    def _metric(self, batch: Batch) -> Any:
        last = batch.last
        fn = logit_diff_metric if self.metric == "logit_diff" else logit_metric

        def metric(logits: Tensor) -> Tensor:  # logits [K, T, V] of K copies of the prompt -> [K]
            K = logits.shape[0]
            return fn(at_positions(logits, last.repeat(K)), batch.answers.to(logits.device).repeat(K, 1),
                      batch.wrong_answers.to(logits.device).repeat(K, 1))
        return metric

    def _total_gradients(self, model: ModelAdapter, sites: list[Site], batch: Batch, clean: dict[tuple, Tensor],
                         metric: Any) -> dict[tuple, Tensor]:
        """dm/du for every node, through the model's own paths (each site written as x_out + 0 * leaves)."""
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in clean.items()}
        ivs = [Intervention(EMBED, lambda x: x + (leaves[("t",)][None] - x.detach()))]
        for j, s in enumerate(sites):
            ivs += _site_interventions(s, lambda f, e, x_out, j=j, s=s: x_out
                                       + (leaves[("f", j)][None] - f.detach()) @ s.d.W_dec.to(x_out.device, x_out.dtype)
                                       + (leaves[("e", j)][None] - e.detach()))
        out = model.run(batch.tokens, interventions=ivs, grad=True)
        keys = list(leaves)
        grads = torch.autograd.grad(metric(out.logits).sum(), [leaves[k] for k in keys], allow_unused=True)
        return {k: (torch.zeros_like(leaves[k]) if g is None else g.detach()) for k, g in zip(keys, grads)}

    def _direct_gradients(self, model: ModelAdapter, sites: list[Site], batch: Batch, point: dict[tuple, Tensor],
                          targets: list[tuple[int, int, int]], metric: Any) -> dict[tuple, Tensor]:
        """d target_k / d leaf for every target k (one copy of the prompt each; the last copy: the metric),
        with every site writing decode(f_leaf) + e_leaf at `point`."""
        K = len(targets) + 1
        leaves = {k: v.detach()[None].repeat((K,) + (1,) * v.dim()).requires_grad_(True) for k, v in point.items()}
        computed: dict[int, Tensor] = {}
        ivs = [Intervention(EMBED, lambda x: leaves[("t",)].to(x.dtype))]
        for j, s in enumerate(sites):
            def write(f, e, x_out, j=j, s=s):
                computed[j] = f
                return s.d.decode(leaves[("f", j)].to(x_out.dtype)) + leaves[("e", j)].to(x_out.dtype)
            ivs += _site_interventions(s, write)
        out = model.run(batch.tokens.repeat(K, 1), interventions=ivs, grad=True)
        m = metric(out.logits)
        values = [computed[j][k, p, i] for k, (j, p, i) in enumerate(targets)] + [m[K - 1]]
        keys = list(leaves)
        grads = torch.autograd.grad(torch.stack(values).sum(), [leaves[k] for k in keys], allow_unused=True)
        return {k: (torch.zeros_like(leaves[k]) if g is None else g.detach()).double() for k, g in zip(keys, grads)}


def _site_interventions(s: Site, write: Any) -> list[Intervention]:
    """Interventions at a dictionary's sites: `write(f, e, x_out)` gives the site's new output, with
    f = encode(x_in) and e = x_out - decode(f) computed from this run's activations (differentiably)."""
    def edit(x_out: Tensor, x_in: Tensor) -> Tensor:
        f = s.d.encode(x_in)
        return write(f, x_out - s.d.decode(f), x_out)

    if s.hook_in == s.hook_out:
        return [Intervention(s.hook_out, lambda x: edit(x, x))]
    stash: dict[str, Tensor] = {}

    def keep(x: Tensor) -> Tensor:
        stash["x_in"] = x
        return x
    return [Intervention(s.hook_in, keep), Intervention(s.hook_out, lambda x: edit(x, stash.pop("x_in")))]


def _node_values(model: ModelAdapter, sites: list[Site], tokens: Tensor) -> dict[tuple, Tensor]:
    """The node values of one prompt (batch of one): ("t",) [T, d]; ("f", j) [T, F]; ("e", j) [T, d]."""
    reads = [EMBED] + [a for s in sites for a in (s.hook_in, s.hook_out)]
    out = model.run(tokens, reads, logits=False)
    values = {("t",): out[EMBED][0].detach()}
    for j, s in enumerate(sites):
        f = s.d.encode(out[s.hook_in][0])
        values[("f", j)] = f.detach()
        values[("e", j)] = (out[s.hook_out][0] - s.d.decode(f)).detach()
    return values


def _top_features(sites: list[Site], attribution: dict[tuple, Tensor], k: int) -> list[tuple[int, int, int]]:
    """(site index, position, feature) of the k features of largest |attribution| (nonzero only)."""
    flat = torch.cat([attribution[("f", j)].abs().flatten() for j in range(len(sites))])
    T, F = attribution[("f", 0)].shape
    order = flat.argsort(descending=True)[:k]
    order = order[flat[order] > 0]
    return sorted((int(i) // (T * F), int(i) % (T * F) // F, int(i) % F) for i in order)


def _assemble(model: ModelAdapter, sites: list[Site], batch: Batch, clean: dict[tuple, Tensor],
              base: dict[tuple, Tensor], attribution: dict[tuple, Tensor], chosen: list[tuple[int, int, int]],
              edges: dict[tuple, Tensor], metric: Any) -> AttributionGraph:
    T = int(batch.lengths[0])
    tokens = model.token_strs(batch.tokens[0, :T].tolist())
    rows: list[dict[str, Any]] = []
    for j, p, i in chosen:
        s = sites[j]
        rows.append({"node": naming.at(naming.feature(s.hook_out.kind, s.hook_out.layer, i), p), "kind": "feature",
                     "site": s.name, "layer": s.layer, "dictionary": s.key,
                     "position": p, "token": tokens[p], "feature": i, "value": float(clean[("f", j)][p, i]),
                     "baseline": float(base[("f", j)][p, i]), "attribution": float(attribution[("f", j)][p, i])})
    for j, s in enumerate(sites):
        for p in range(T):
            rows.append({"node": naming.at(naming.dictionary_error(s.hook_out.kind, s.hook_out.layer), p),
                         "kind": "error", "site": s.name, "layer": s.layer,
                         "dictionary": s.key, "position": p, "token": tokens[p], "feature": None,
                         "value": float(clean[("e", j)][p].norm()), "baseline": float(base[("e", j)][p].norm()),
                         "attribution": float(attribution[("e", j)][p])})
    for p in range(T):
        rows.append({"node": naming.at("input", p), "kind": "token", "site": None, "layer": None, "dictionary": None,
                     "position": p,
                     "token": tokens[p], "feature": None, "value": float(clean[("t",)][p].norm()),
                     "baseline": float(base[("t",)][p].norm()), "attribution": float(attribution[("t",)][p])})
    rows.append({"node": "metric", "kind": "metric", "site": None, "layer": None, "dictionary": None, "position": T - 1,
                 "token": tokens[T - 1], "feature": None, "value": None, "baseline": None, "attribution": None})
    N = len(rows)
    n_f = len(chosen)
    A = torch.zeros(N, N, dtype=torch.float64)
    target_rows = list(range(n_f)) + [N - 1]  # copy k of the direct pass -> its node's row
    for k, r in enumerate(target_rows):
        for c, (j, p, i) in enumerate(chosen):
            A[r, c] = edges[("f", j)][k, p, i]
        col = n_f
        for j in range(len(sites)):
            A[r, col:col + T] = edges[("e", j)][k, :T]
            col += T
        A[r, col:col + T] = edges[("t",)][k, :T]
    incoming = torch.zeros(N, dtype=torch.float64)
    for k, r in enumerate(target_rows):  # every source, kept or not
        incoming[r] = sum(float(v[k].sum()) for v in edges.values())
    nodes = pd.DataFrame(rows)
    kinds = nodes["kind"].to_numpy()
    nodes["influence"] = node_influence(A, kinds).numpy()
    nodes["incoming_sum"] = np.where(np.isin(np.arange(N), target_rows), incoming.numpy(), np.nan)
    change = [float(clean[("f", j)][p, i] - base[("f", j)][p, i]) for j, p, i in chosen]
    nodes["target_change"] = change + [np.nan] * (N - n_f - 1) + [np.nan]
    for col in ("layer", "position", "feature"):
        nodes[col] = pd.array(nodes[col], dtype="Int64")
    return AttributionGraph(nodes, A)


def collapse(graphs: list[AttributionGraph]) -> AttributionGraph:
    """The dataset's graph: positions summed into one node per (site, feature), per site's error, one
    token node and the metric; adjacencies averaged over prompts (graph_stats.py)."""
    return _dataset_graph(*stacked(graphs))


def _dataset_graph(nodes: pd.DataFrame, mats: list[Tensor], attribution: np.ndarray) -> AttributionGraph:
    A = torch.stack(mats).mean(0)
    nodes = nodes.copy()
    nodes.insert(nodes.columns.get_loc("prompts"), "attribution", attribution.mean(0))
    nodes["influence"] = node_influence(A, nodes["kind"].to_numpy()).numpy()
    for col in ("layer", "feature"):
        nodes[col] = pd.array(nodes[col], dtype="Int64")
    return AttributionGraph(nodes, A)


class GraphResult(Result):
    """A feature graph result; also saves the edges (strongest 200 per prompt) and the scores."""

    def save_extra(self, folder: Any, files: list[str]) -> None:
        edges = pd.concat([g.edges(top=200).assign(example=i) for i, g in enumerate(self.extra["graphs"])],
                          ignore_index=True)
        edges.to_csv(folder / "edges.csv", index=False)
        self.extra["score_table"].to_csv(folder / "scores.csv", index=False)
        files += ["edges.csv", "scores.csv"]
