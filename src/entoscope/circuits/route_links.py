"""A prompt's route as networkx's node-link data, built without importing networkx.

IFR stores each prompt's route as JSON in its per-prompt arrays; building a networkx graph only to
serialise it made every first call import networkx (a third of a GPT-2-small-sized first call). `LinkGraph`
records nodes and keyed edges with the parts of the `MultiDiGraph` interface that `ifr.route_graph` uses and
writes what `networkx.node_link_data(g, edges="edges")` writes for the same calls, in the same order:
nodes in insertion order, edges grouped by source node (node order), then by target (order first
linked from that source), then by key (insertion order). `RouteGraphs` reads it back with networkx.
"""

from __future__ import annotations

from typing import Any


class LinkGraph:
    """A directed multigraph's nodes, keyed edges and graph attributes, for `node_link_data`."""

    def __init__(self, **graph: Any) -> None:
        self.graph = dict(graph)
        self.nodes: dict[str, dict[str, Any]] = {}
        self._out: dict[str, dict[str, dict[Any, dict[str, Any]]]] = {}

    def __contains__(self, node: str) -> bool:
        return node in self.nodes

    def add_node(self, node: str, **attrs: Any) -> None:
        self.nodes.setdefault(node, {}).update(attrs)
        self._out.setdefault(node, {})

    def add_edge(self, u: str, v: str, key: Any, **attrs: Any) -> None:
        for end in (u, v):
            if end not in self.nodes:
                self.add_node(end)
        self._out[u].setdefault(v, {}).setdefault(key, {}).update(attrs)

    def node_link_data(self) -> dict[str, Any]:
        """The dict `networkx.node_link_data(g, edges="edges")` gives for a MultiDiGraph built by the same calls."""
        return {"directed": True, "multigraph": True, "graph": self.graph,
                "nodes": [{**attrs, "id": n} for n, attrs in self.nodes.items()],
                "edges": [{**d, "source": u, "target": v, "key": k}
                          for u, targets in self._out.items() for v, keyed in targets.items()
                          for k, d in keyed.items()]}
