"""The component graph in the MIB / EAP vocabulary, its edges as dense tensors, and circuits on it.

Nodes (parseable ids):
  senders    `input` (embeddings entering block 0), `a{L}.h{H}` (attention head), `m{L}` (MLP)
  receivers  `a{L}.h{H}<q>`, `a{L}.h{H}<k>`, `a{L}.h{H}<v>` (what head H reads as query, key,
             value), `m{L}`, `logits`
Edges are named `{sender}->{receiver}`: `input->a0.h0<q>`, `a0.h0->m1`, `m1->logits` (MIB's names).

A sender feeds every receiver downstream of it: all receivers of later layers, and, in sequential
blocks (GPT-2, Llama), the MLP of its own layer. In parallel blocks (NeoX) the MLP of layer L reads
the same state as attention L, so `a{L}.h{H} -> m{L}` does not exist. GPT-2 small has 32,491 edges.

Grouped-query attention (n_kv_heads < n_heads, g = n_heads / n_kv_heads): the key and the value
are computed once per key/value head and shared by its g query heads, so the k and v receivers are
per key/value head and named by it: `a{L}.kv{J}<k>`, `a{L}.kv{J}<v>` (read by query heads
J*g .. J*g+g-1). Query receivers stay per head. With g = 1 the names are MIB's `a{L}.h{H}<k>`.
(MIB's own GQA graphs ungroup k/v per query head; those edges have no exact counterpart here.)

Scores and circuits are dense [n_senders, n_receivers] tensors (`Circuit`); `Node`/`Edge` are thin
views for reading them. Saving: MIB/EAP-IG's JSON (`cfg`, `nodes`, `edges` with `score` and
`in_graph`), GraphML (networkx), and the HTML drawing (`figures.py`, `circuit_figure`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import naming
from ..errors import ConfigError, UnknownNameError
from ..metrics import readable
from ..models.split_inputs import Layout
from ..models.structure import Structure

_NODE = re.compile(r"^(?:input|logits|m(\d+)|a(\d+)\.(h|kv)(\d+))$")
_RECEIVER = re.compile(r"^(?P<node>[a-z0-9.]+?)(?:<(?P<qkv>[qkv])>)?$")


@dataclass(frozen=True)
class Node:
    """A node of the graph: kind is input | head | mlp | logits | kv (a key/value head: receives only)."""

    name: str
    kind: str
    layer: int | None = None
    head: int | None = None

    @staticmethod
    def parse(name: str) -> Node:
        m = _NODE.match(name)
        if not m:
            raise UnknownNameError(f"{name!r} is not a node id", code="unknown_node",
                                   remedy="nodes are input, a{L}.h{H}, a{L}.kv{J}, m{L}, logits")
        if name in ("input", "logits"):
            return Node(name, name)
        if m.group(1) is not None:
            return Node(name, "mlp", int(m.group(1)))
        kind = "head" if m.group(3) == "h" else "kv"
        return Node(name, kind, int(m.group(2)), int(m.group(4)))


@dataclass(frozen=True)
class Edge:
    """One edge: its MIB name, sender, receiver (with <q|k|v> for attention), and where it is."""

    name: str
    sender: str
    receiver: str
    target: str  # the receiver's node (`a1.h0` for `a1.h0<k>`)
    qkv: str | None
    index: tuple[int, int]  # (sender index, receiver index) into the dense tensors
    score: float | None = None
    in_circuit: bool | None = None


class ComponentGraph:
    """Senders, receivers and which edges exist, for one model shape."""

    def __init__(self, n_layers: int, n_heads: int, n_kv_heads: int | None = None, parallel: bool = False,
                 d_model: int | None = None) -> None:
        n_kv_heads = n_kv_heads or n_heads
        if n_layers < 1 or n_heads < 1 or n_heads % n_kv_heads:
            raise ConfigError(f"no component graph for {n_layers} layers, {n_heads} heads, {n_kv_heads} "
                              "key/value heads", code="bad_graph_shape",
                              remedy="layers and heads must be positive; heads a multiple of key/value heads")
        self.layout = Layout(n_layers, n_heads, n_kv_heads, parallel)
        self.d_model = d_model

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_structure(cls, s: Structure) -> ComponentGraph:
        return cls(s.n_layers, s.n_heads, s.n_kv_heads, s.parallel, s.d_model)

    @classmethod
    def from_model(cls, model: Any) -> ComponentGraph:
        from ..models.adapter import adapt

        return cls.from_structure(adapt(model).structure)

    @classmethod
    def from_config(cls, cfg: Any) -> ComponentGraph:
        """From a HuggingFace config (GPT2Config, GPTNeoXConfig, LlamaConfig, ...) or a TransformerLens
        config, or a dict of either: no weights needed."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))

        def first(*keys: str) -> Any:
            for k in keys:
                if get(k) is not None:
                    return get(k)
            return None

        n_layers = first("n_layers", "num_hidden_layers", "n_layer")
        n_heads = first("n_heads", "num_attention_heads", "n_head")
        if n_layers is None or n_heads is None:
            raise ConfigError("this config names no layer or head count", code="bad_graph_shape",
                              remedy="give n_layers/num_hidden_layers and n_heads/num_attention_heads")
        n_kv = first("n_key_value_heads", "num_key_value_heads")
        parallel = first("parallel_attn_mlp", "use_parallel_residual")
        d_model = first("d_model", "hidden_size", "n_embd")
        return cls(int(n_layers), int(n_heads), int(n_kv) if n_kv else None, bool(parallel),
                   int(d_model) if d_model else None)

    def config(self) -> dict[str, Any]:
        """MIB/EAP-IG's `cfg` block."""
        lay = self.layout
        cfg: dict[str, Any] = {"n_layers": lay.n_layers, "n_heads": lay.n_heads,
                               "parallel_attn_mlp": lay.parallel, "d_model": self.d_model}
        if lay.n_kv_heads != lay.n_heads:
            cfg["n_key_value_heads"] = lay.n_kv_heads
        return cfg

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ComponentGraph) and self.layout == other.layout

    def __hash__(self) -> int:
        return hash(self.layout)

    def __repr__(self) -> str:
        return (f"<ComponentGraph {self.layout.n_layers} layers x {self.layout.n_heads} heads: "
                f"{self.n_senders} senders, {self.n_receivers} receivers, {self.n_edges} edges>")

    # ------------------------------------------------------------------ names
    @property
    def grouped(self) -> bool:
        return self.layout.n_kv_heads != self.layout.n_heads

    @cached_property
    def senders(self) -> list[str]:
        out = ["input"]
        for L in range(self.layout.n_layers):
            out += [naming.head(L, h) for h in range(self.layout.n_heads)] + [naming.mlp(L)]
        return out

    @cached_property
    def receivers(self) -> list[str]:
        kv = "kv" if self.grouped else "h"
        out = []
        for L in range(self.layout.n_layers):
            out += [f"a{L}.h{h}<q>" for h in range(self.layout.n_heads)]
            out += [f"a{L}.{kv}{j}<k>" for j in range(self.layout.n_kv_heads)]
            out += [f"a{L}.{kv}{j}<v>" for j in range(self.layout.n_kv_heads)]
            out.append(f"m{L}")
        out.append("logits")
        return out

    @cached_property
    def _sender_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.senders)}

    @cached_property
    def _receiver_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.receivers)}

    @property
    def n_senders(self) -> int:
        return self.layout.n_senders

    @property
    def n_receivers(self) -> int:
        return self.layout.n_receivers

    @cached_property
    def mask(self) -> Tensor:
        """[n_senders, n_receivers] bool: the edges that exist."""
        return self.layout.edge_mask()

    @property
    def n_edges(self) -> int:
        return int(self.mask.sum())

    def sender_index(self, name: str) -> int:
        if name not in self._sender_index:
            raise UnknownNameError(f"{name!r} is not a sender of this graph", code="unknown_node",
                                   remedy=f"senders are input, a{{L}}.h{{H}}, m{{L}} (layers "
                                   f"0..{self.layout.n_layers - 1}, heads 0..{self.layout.n_heads - 1})")
        return self._sender_index[name]

    def receiver_index(self, name: str) -> int:
        if name not in self._receiver_index:
            raise UnknownNameError(f"{name!r} is not a receiver of this graph", code="unknown_node",
                                   remedy="receivers are a{L}.h{H}<q|k|v> (a{L}.kv{J}<k|v> under grouped-query "
                                   "attention), m{L}, logits")
        return self._receiver_index[name]

    def edge_index(self, name: str) -> tuple[int, int]:
        """(sender index, receiver index) of an edge name like `a0.h1->a1.h2<k>`."""
        if "->" not in name:
            raise UnknownNameError(f"{name!r} is not an edge name", code="unknown_edge",
                                   remedy="edges are written SENDER->RECEIVER, e.g. a0.h1->a1.h2<k>")
        sender, receiver = name.split("->", 1)
        s, r = self.sender_index(sender), self.receiver_index(receiver)
        if not self.mask[s, r]:
            raise UnknownNameError(f"{name}: {sender} is not upstream of {receiver}", code="unknown_edge",
                                   remedy="a sender feeds only receivers of later layers (and, in sequential "
                                   "blocks, the MLP of its own layer)")
        return s, r

    def edge_name(self, s: int, r: int) -> str:
        return f"{self.senders[s]}->{self.receivers[r]}"

    def edge_names(self) -> list[str]:
        """Every edge, receiver-major in the model's order (as MIB lists them)."""
        idx = self.mask.T.nonzero()
        return [self.edge_name(int(s), int(r)) for r, s in idx]

    @staticmethod
    def receiver_parts(receiver: str) -> tuple[str, str | None]:
        """(`a1.h0`, `k`) for `a1.h0<k>`; (`m1`, None) for `m1`."""
        m = _RECEIVER.match(receiver)
        assert m is not None, receiver
        return m.group("node"), m.group("qkv")

    @cached_property
    def receiver_owners(self) -> list[list[int]]:
        """For each receiver, the senders whose computation reads it (none for logits)."""
        lay = self.layout
        g = lay.n_heads // lay.n_kv_heads
        out: list[list[int]] = []
        for L in range(lay.n_layers):
            heads = list(range(lay.head_senders(L).start, lay.head_senders(L).stop))
            out += [[h] for h in heads]
            out += [heads[j * g:(j + 1) * g] for j in range(lay.n_kv_heads)] * 2
            out.append([lay.mlp_sender(L)])
        out.append([])
        return out

    @cached_property
    def owner_matrix(self) -> Tensor:
        """[n_receivers, n_senders] bool: receiver r is read by sender s's computation."""
        m = torch.zeros(self.n_receivers, self.n_senders, dtype=torch.bool)
        for r, owners in enumerate(self.receiver_owners):
            m[r, owners] = True
        return m

    @cached_property
    def edge_pairs(self) -> Tensor:
        """[n_edges, 2] (sender, receiver) of every edge, receiver-major (the order `edges()` lists them)."""
        return self.mask.T.nonzero().flip(1).contiguous()

    @cached_property
    def _receiver_parts_all(self) -> list[tuple[str, str | None]]:
        return [self.receiver_parts(r) for r in self.receivers]

    def edges(self, scores: Tensor | None = None, kept: Tensor | None = None, only_kept: bool = False) -> list[Edge]:
        """Every edge (receiver-major), with its score and whether it is kept where given; `only_kept`: the kept
        ones only."""
        idx = self.edge_pairs
        if only_kept and kept is not None:
            idx = idx[kept[idx[:, 0], idx[:, 1]]]
        pairs = idx.tolist()
        n = len(pairs)
        score_list = [None] * n if scores is None else scores[idx[:, 0], idx[:, 1]].tolist()
        kept_list = [None] * n if kept is None else kept[idx[:, 0], idx[:, 1]].bool().tolist()
        senders, receivers, parts = self.senders, self.receivers, self._receiver_parts_all
        return [Edge(f"{senders[s]}->{receivers[r]}", senders[s], receivers[r], *parts[r], (s, r), sc, k)
                for (s, r), sc, k in zip(pairs, score_list, kept_list)]


class Circuit:
    """Edge scores and a set of kept edges on a `ComponentGraph` (dense [n_senders, n_receivers])."""

    def __init__(self, graph: ComponentGraph, scores: Tensor | None = None, kept: Tensor | None = None) -> None:
        self.graph = graph
        shape = (graph.n_senders, graph.n_receivers)
        for name, t in (("scores", scores), ("kept", kept)):
            if t is not None and tuple(t.shape) != shape:
                raise ConfigError(f"{name} has shape {tuple(t.shape)}, the graph needs {shape}",
                                  code="bad_graph_shape", remedy="build scores from the same graph")
        self.scores = None if scores is None else readable(scores.detach()).cpu().masked_fill(~graph.mask, 0.0)
        self.kept = (graph.mask.clone() if kept is None else kept.detach().bool().cpu() & graph.mask)

    @property
    def n_kept(self) -> int:
        return int(self.kept.sum())

    @property
    def fraction(self) -> float:
        return self.n_kept / self.graph.n_edges

    def with_kept(self, kept: Tensor) -> Circuit:
        return Circuit(self.graph, self.scores, kept)

    def edges(self, only_kept: bool = False) -> list[Edge]:
        return self.graph.edges(self.scores, self.kept, only_kept=only_kept)

    def __repr__(self) -> str:
        return f"<Circuit {self.n_kept} of {self.graph.n_edges} edges kept>"

    # ------------------------------------------------------------------ pruning
    def live_nodes(self) -> tuple[Tensor, Tensor]:
        """(reached [n_senders]: sender has a kept path from input; useful [n_senders]: a kept path to logits)."""
        g, kept = self.graph, self.kept
        owner = g.owner_matrix.float()  # [R, S]
        reached = torch.zeros(g.n_senders, dtype=torch.bool)
        reached[0] = True
        while True:  # one step per layer at most
            into = (kept & reached[:, None]).any(0).float()  # [R]: receivers with a kept edge from a reached sender
            new = reached | ((into @ owner) > 0)
            if torch.equal(new, reached):
                break
            reached = new
        useful = torch.zeros(g.n_senders, dtype=torch.bool)
        live_receivers = torch.zeros(g.n_receivers, dtype=torch.bool)
        live_receivers[-1] = True
        while True:
            new = (kept & live_receivers[None, :]).any(1)
            live_r = live_receivers | ((owner @ new.float()) > 0)
            if torch.equal(new, useful) and torch.equal(live_r, live_receivers):
                break
            useful, live_receivers = new, live_r
        return reached, useful

    def pruned(self) -> Circuit:
        """Without the edges that cannot change the output: from a sender with no kept path from the
        input (its output is then exactly its corrupt value) or into a computation with no kept path
        to the logits. Running the pruned circuit gives the same output."""
        reached, useful = self.live_nodes()
        owner = self.graph.owner_matrix
        receiver_useful = (owner & useful[None, :]).any(1)
        receiver_useful[-1] = True
        return self.with_kept(self.kept & reached[:, None] & receiver_useful[None, :])

    # ------------------------------------------------------------------ export
    def table(self, extra: dict[str, Any] | None = None) -> Any:
        """One row per edge, best |score| first; `extra` columns are given in `edges()` order."""
        import pandas as pd

        edges = self.edges()
        frame = pd.DataFrame({"edge": [e.name for e in edges], "sender": [e.sender for e in edges],
                              "receiver": [e.receiver for e in edges], "qkv": [e.qkv or "" for e in edges],
                              "score": [e.score if e.score is not None else float("nan") for e in edges],
                              "in_circuit": [e.in_circuit for e in edges]})
        for name, values in (extra or {}).items():
            frame[name] = values
        if self.scores is not None:
            frame["abs_score"] = frame["score"].abs()
            frame = frame.sort_values("abs_score", ascending=False, kind="stable").drop(columns="abs_score")
            frame.insert(0, "rank", range(1, len(frame) + 1))
        return frame.reset_index(drop=True)

    def node_names(self) -> list[str]:
        g = self.graph
        names = list(g.senders) + ["logits"]
        if g.grouped:
            names += [f"a{L}.kv{j}" for L in range(g.layout.n_layers) for j in range(g.layout.n_kv_heads)]
        return names

    def nodes_in_circuit(self) -> dict[str, bool]:
        """A node is in the circuit when it has a kept edge (in or out); logits always."""
        g = self.graph
        out_any = self.kept.any(1)
        in_any = self.kept.any(0)
        status = {name: bool(out_any[i]) for i, name in enumerate(g.senders)}
        for r, name in enumerate(g.receivers):
            node, _ = g.receiver_parts(name)
            status[node] = status.get(node, False) or bool(in_any[r])
        status["input"] = bool(out_any[0])
        status["logits"] = True
        return {n: status.get(n, False) for n in self.node_names()}

    def to_networkx(self, only_kept: bool = False) -> Any:
        """A networkx MultiDiGraph: nodes with kind/layer/head/in_circuit; one edge per graph edge,
        keyed by its MIB name, with qkv, score and in_circuit. Under grouped-query attention each
        key/value node `a{L}.kv{J}` also has edges (kind "reads") to the query heads that read it."""
        import networkx as nx

        G = nx.MultiDiGraph()
        status = self.nodes_in_circuit()
        for name in self.node_names():
            node = Node.parse(name)
            if only_kept and not status[name]:
                continue
            G.add_node(name, kind=node.kind, layer=-1 if node.layer is None else node.layer,
                       head=-1 if node.head is None else node.head, in_circuit=status[name])
        for e in self.edges(only_kept=only_kept):
            G.add_edge(e.sender, e.target, key=e.name, qkv=e.qkv or "", kind="edge",
                       score=float("nan") if e.score is None else e.score, in_circuit=bool(e.in_circuit))
        if self.graph.grouped:
            g = self.graph.layout.n_heads // self.graph.layout.n_kv_heads
            for L in range(self.graph.layout.n_layers):
                for h in range(self.graph.layout.n_heads):
                    kv, head = f"a{L}.kv{h // g}", f"a{L}.h{h}"
                    if kv in G and head in G:
                        G.add_edge(kv, head, key=f"{kv}=>{head}", qkv="", kind="reads", score=float("nan"),
                                   in_circuit=bool(status[kv] and status[head]))
        return G

    def to_json(self) -> dict[str, Any]:
        """MIB / EAP-IG's circuit JSON: cfg, nodes {name: {in_graph}}, edges {name: {score, in_graph}}."""
        status = self.nodes_in_circuit()
        edges = {e.name: {"score": 0.0 if e.score is None or e.score != e.score else e.score,
                          "in_graph": bool(e.in_circuit)} for e in self.edges()}  # NaN (unscored) -> 0
        return {"cfg": self.graph.config(), "nodes": {n: {"in_graph": v} for n, v in status.items()}, "edges": edges}

    @classmethod
    def from_json(cls, source: str | Path | dict[str, Any]) -> Circuit:
        d = source if isinstance(source, dict) else json.loads(Path(source).read_text())
        if not all(k in d for k in ("cfg", "edges")):
            raise ConfigError("not a circuit JSON (needs cfg and edges)", code="bad_circuit_file",
                              remedy="give a file written by Circuit.save_json or MIB/EAP-IG's Graph.to_json")
        graph = ComponentGraph.from_config(d["cfg"])
        scores = torch.zeros(graph.n_senders, graph.n_receivers)
        kept = torch.zeros_like(scores, dtype=torch.bool)
        for name, info in d["edges"].items():
            s, r = graph.edge_index(name)
            scores[s, r] = float(info.get("score", 0.0))
            kept[s, r] = bool(info.get("in_graph", False))
        return cls(graph, scores, kept)

    def save_json(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.to_json()), encoding="utf-8")
        return p

    def save_graphml(self, path: str | Path, only_kept: bool = False) -> Path:
        import networkx as nx

        p = Path(path)
        nx.write_graphml(self.to_networkx(only_kept=only_kept), str(p), prettyprint=False)
        return p
