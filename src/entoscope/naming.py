"""One spelling for every component and site, everywhere: tables' id columns, figure axes and hover
text, takeaways and the command line (the scheme is defined for readers in docs/pages.md and in the
report's glossary, report/glossary.py).

    a{L}.h{H}      attention head H of layer L: its output (z, or z @ W_O)
    a{L}.kv{J}     key/value head J of layer L (grouped-query attention)
    a{L}           attention layer L's output (attn_out: every head and b_O)
    a{L}.b_O       attention layer L's output bias
    m{L}           MLP L's output (mlp_out, b_out included)
    m{L}.n{N}      neuron N of MLP L: its activation (mlp_post); in DLA mlp_post[N] W_out[N]
    m{L}.b_out     MLP L's output bias
    {kind}.{L}     any other activation by its canonical name: resid_pre.2, mlp_in.1, q.0
      .h{H} .kv{J} .n{N} .f{F}   ... its head, key/value head, neuron, or dictionary feature F
      .error       a dictionary's reconstruction error at that site (attribution graphs)
    @{POS}         at a position: a token index (3), counted from each prompt's end (END is its last
                   token, END-1 the one before), or a role (IO, S2; S2+1 is the token after S2); @{Q}:{K} for a
                   query position and a key position
    <q> <k> <v>    a head's query, key or value input (a receiver of a circuit edge)
    A->B           the edge from sender A to receiver B (circuits)
    input, logits, embed, pos_embed   the token embeddings (as a circuit's sender), the output, W_E, W_pos
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HEAD_KINDS = ("z", "result")  # a head's own output: the component itself


def head(layer: int, h: int) -> str:
    return f"a{int(layer)}.h{int(h)}"


def kv_head(layer: int, j: int) -> str:
    return f"a{int(layer)}.kv{int(j)}"


def attention(layer: int) -> str:
    return f"a{int(layer)}"


def mlp(layer: int) -> str:
    return f"m{int(layer)}"


def neuron(layer: int, n: int) -> str:
    return f"m{int(layer)}.n{int(n)}"


def activation(kind: str, layer: int | None) -> str:
    """The component an activation of `kind` at `layer` is the output of, or its canonical name."""
    if layer is None:
        return kind
    if kind == "attn_out":
        return attention(layer)
    if kind == "mlp_out":
        return mlp(layer)
    return f"{kind}.{int(layer)}"


def feature(kind: str, layer: int | None, i: int) -> str:
    """Feature i of the dictionary at the site `kind`.`layer` (resid_post.1.f256; a transcoder's: m1.f12)."""
    return f"{activation(kind, layer)}.f{int(i)}"


def dictionary_error(kind: str, layer: int | None) -> str:
    return f"{activation(kind, layer)}.error"


def at(name: str, position: Any) -> str:
    """`name` at a position (a token index, an offset from the end or a role, as sites.position_text writes it)."""
    return f"{name}@{position}"


def site(kind: str, coord: Mapping[str, Any]) -> str:
    """The name of one unit of a site grid: `kind` the activation read (for dictionary features, the
    activation the dictionary reads and writes), `coord` its axes (layer, head, kv_head, neuron,
    feature, pos, query_pos, key_pos; positions already written as text where they are roles)."""
    c = dict(coord)
    layer = c.get("layer")
    if "head" in c and kind in HEAD_KINDS and layer is not None:
        name = head(layer, c["head"])
    elif "kv_head" in c and kind in HEAD_KINDS and layer is not None:
        name = kv_head(layer, c["kv_head"])
    elif "neuron" in c and kind == "mlp_post" and layer is not None:
        name = neuron(layer, c["neuron"])
    else:
        name = activation(kind, layer)
        for axis, short in (("head", "h"), ("kv_head", "kv"), ("neuron", "n"), ("feature", "f")):
            if axis in c:
                name += f".{short}{int(c[axis])}"
    if "pos" in c:
        name = at(name, c["pos"])
    elif "query_pos" in c or "key_pos" in c:
        name = at(name, f"{c.get('query_pos', '')}:{c.get('key_pos', '')}")
    return name
