"""The residual stream at one position per prompt as the sum of everything that wrote to it.

    resid_post.(L-1) = embed + pos_embed + sum_l [ sum_h a{l}.h{h} + a{l}.b_O + m{l} ]

Components (labels in brackets):
  embed [embed]            W_E[token]
  pos_embed [pos_embed]    W_pos[position] (learned positions only; rotary adds nothing)
  head [a{l}.h{h}]         z_h @ W_O[h], TransformerLens's `result` (b_O excluded)
  attn_bias [a{l}.b_O]     the attention output bias b_O of layer l (zeros where the model has none)
  mlp [m{l}]               mlp_out of layer l, b_out INCLUDED
  neuron [m{l}.n{n}]       with neuron_layers: mlp_post[n] * W_out[n] ...
  mlp_bias [m{l}.b_out]    ... and then b_out is its own component, so the neurons + b_out = m{l}
The identity holds exactly (up to float rounding) for sequential and parallel blocks alike, on
every backend: the tests check it against resid_post on each tiny family and bridge mode.

Post-norm families (Gemma 2/3, docs/families.md): what a block adds is post_ln(attention output) and
post_ln(MLP output). Each head, b_O, each neuron and b_out is carried through its post-norm with the
norm's scale FROZEN at this run (models/post_norms.py, read at ln1_post_scale / ln2_post_scale):
    a{l}.h{h} = (z_h @ W_O[h]) * g1 / s1,  a{l}.b_O = b_O * g1 / s1,
    m{l}.n{n} = mlp_post[n] W_out[n] * g2 / s2,  m{l}.b_out = b_out * g2 / s2,  m{l} = mlp_out
(g = 1 + the norm's weight), so the heads plus a{l}.b_O are attn_out and the identity above holds as it is.

Two entry points share one component list:
  component_vectors(...)  -> [C, B, d_model], the vectors themselves (for anyone who needs them);
  component_dots(...)     -> [C, B], each component dotted with one direction per prompt, in
                            float64; neurons are projected through W_out without materialising
                            [d_mlp, d_model] vectors per prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import naming
from ..models.adapter import ModelAdapter
from ..models.names import ActName
from ..models.post_norms import post_scale_reads, through_post_norm
from ..models.structure import Structure


@dataclass(frozen=True)
class Component:
    """One writer to the residual stream (one row of a decomposition)."""

    label: str
    kind: str  # embed | pos_embed | head | attn_bias | mlp | neuron | mlp_bias
    layer: int | None = None
    head: int | None = None
    neuron: int | None = None


def components(structure: Structure, neuron_layers: Iterable[int] = ()) -> list[Component]:
    """Every component of the final residual stream, in the order of the model's computation."""
    split = set(neuron_layers)
    out = [Component("embed", "embed")]
    if structure.positional == "learned":
        out.append(Component("pos_embed", "pos_embed"))
    for L in range(structure.n_layers):
        out += [Component(naming.head(L, h), "head", L, head=h) for h in range(structure.n_heads)]
        out.append(Component(f"{naming.attention(L)}.b_O", "attn_bias", L))
        if L in split:
            out += [Component(naming.neuron(L, n), "neuron", L, neuron=n) for n in range(structure.d_mlp)]
            out.append(Component(f"{naming.mlp(L)}.b_out", "mlp_bias", L))
        else:
            out.append(Component(naming.mlp(L), "mlp", L))
    return out


def decomposition_reads(structure: Structure, neuron_layers: Iterable[int] = ()) -> list[ActName]:
    """The activations a run must read for `component_vectors` / `component_dots`."""
    split = set(neuron_layers)
    reads = [ActName("embed")] + ([ActName("pos_embed")] if structure.positional == "learned" else [])
    for L in range(structure.n_layers):
        reads += [ActName("z", L), ActName("mlp_post" if L in split else "mlp_out", L),
                  *post_scale_reads(structure, L, "attn"), *(post_scale_reads(structure, L, "mlp") if L in split else [])]
    return reads


def _at(act: Tensor, positions: Tensor) -> Tensor:
    """act[b, positions[b]] for every prompt of the batch."""
    return act[torch.arange(act.shape[0], device=act.device), positions.to(act.device)]


def _post_scale(model: ModelAdapter, acts: dict[ActName, Tensor], positions: Tensor, layer: int,
                which: str) -> Tensor | None:
    """The post-norm's scale of this run at positions[b], [1, B, 1] (None without post-norms)."""
    reads = post_scale_reads(model.structure, layer, which)
    return _at(acts[reads[0]], positions)[None] if reads else None


def _dense_parts(model: ModelAdapter, acts: dict[ActName, Tensor], positions: Tensor, neuron_layers: set[int],
                 dtype: torch.dtype) -> Iterator[tuple[str, int | None, Tensor]]:
    """(kind, layer, vectors [n, B, d_model]) per block of components, neurons excepted (kind "neurons"
    carries mlp_post [B, d_mlp] instead; `_neuron_post` carries them through a post-norm), in
    `components` order. Heads and biases are carried through their post-norms here. A generator: a caller that
    reduces each block as it comes (component_dots) holds one layer's vectors and one W_O in `dtype` at a time."""
    w, s = model.weights, model.structure
    B = positions.shape[0]
    yield "embed", None, _at(acts[ActName("embed")], positions)[None]
    if s.positional == "learned":
        yield "pos_embed", None, _at(acts[ActName("pos_embed")], positions)[None]
    for L in range(s.n_layers):
        z = _at(acts[ActName("z", L)], positions).to(dtype)  # [B, H, d_head]
        s1 = _post_scale(model, acts, positions, L, "attn")
        heads = torch.einsum("bhd,hdm->hbm", z, w.W_O(L).to(dtype))
        yield "heads", L, through_post_norm(model, L, "attn", heads, s1)
        yield "attn_bias", L, through_post_norm(model, L, "attn", w.b_O(L).to(dtype).expand(1, B, -1), s1)
        if L in neuron_layers:
            yield "neurons", L, _at(acts[ActName("mlp_post", L)], positions).to(dtype)
            s2 = _post_scale(model, acts, positions, L, "mlp")
            yield "mlp_bias", L, through_post_norm(model, L, "mlp", w.b_out(L).to(dtype).expand(1, B, -1), s2)
        else:
            yield "mlp", L, _at(acts[ActName("mlp_out", L)], positions)[None]


def component_vectors(model: ModelAdapter, acts: dict[ActName, Tensor], positions: Tensor,
                      neuron_layers: Iterable[int] = (), dtype: torch.dtype = torch.float32) -> Tensor:
    """[C, B, d_model]: each component's vector at positions[b] of prompt b (order of `components`)."""
    split = set(neuron_layers)
    out = []
    for kind, layer, x in _dense_parts(model, acts, positions, split, dtype):
        if kind == "neurons":
            x = x.T[:, :, None] * model.weights.W_out(layer).to(dtype)[:, None, :]  # [d_mlp, B, d_model]
            x = through_post_norm(model, layer, "mlp", x, _post_scale(model, acts, positions, layer, "mlp"))  # type: ignore[arg-type]
        out.append(x.to(dtype))
    return torch.cat(out)


def component_dots(model: ModelAdapter, acts: dict[ActName, Tensor], positions: Tensor, directions: Tensor,
                   neuron_layers: Iterable[int] = ()) -> Tensor:
    """[C, B]: component c of prompt b dotted with directions[b] ([B, d_model]), in float64."""
    split = set(neuron_layers)
    d = directions.to(torch.float64)
    out = []
    for kind, layer, x in _dense_parts(model, acts, positions, split, torch.float64):
        if kind == "neurons":
            # mlp_post[b, n] * (W_out[n] . d_b), without building the [d_mlp, B, d_model] vectors; under a
            # post-norm, d_b is pulled back through its frozen linear part (the adjoint: centre(g d_b) / s_b)
            post = model.weights.post_norm(layer, "mlp") if model.structure.post_norms else None  # type: ignore[arg-type]
            d_l = d
            if post is not None:
                scale = _post_scale(model, acts, positions, layer, "mlp")[0].to(torch.float64)  # type: ignore[arg-type,index]
                d_l = post.center(d * post.weight.to(torch.float64) if post.weight is not None else d) / scale
            out.append((x * (d_l @ model.weights.W_out(layer).to(torch.float64).T)).T)
        else:
            out.append((x.to(torch.float64) * d[None]).sum(-1))
    return torch.cat(out)
