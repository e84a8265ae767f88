"""Where a direction can be written, and what writing it there means on this model.

A steerable site holds one vector per token: kinds with axes (pos, X) (the residual stream, attention
and MLP outputs and inputs, neurons, a dictionary's features) or (pos, head, X) with a head chosen
(q, k, v, z, result). `residual` names the whole residual stream (Arditi et al. 2024): every point a
block or the unembedding reads it, resid_pre.L for every layer, resid_mid.L where attention and MLP run
one after the other, and the last resid_post; projecting a direction out at all of them is the same as
orthogonalising every weight that writes the residual stream.

What a site means (docs/steering.md):
- grouped-query attention: k.L / v.L have one head per key/value head; steering kv head g changes what
  every query head of its group (g * group .. g * group + group - 1) reads.
- parallel blocks (GPT-NeoX): attention and MLP both read resid_pre.L, so there is no resid_mid, and
  steering attn_out.L reaches the MLP of the same layer only through later layers.
"""

from __future__ import annotations

from ..errors import SiteError
from ..models.adapter import ModelAdapter
from ..models.names import ActName

HEAD_AXES = ("head", "kv_head")
RESIDUAL = "residual"


def steerable(model: ModelAdapter, site: str | ActName, head: int | None) -> tuple[ActName, int]:
    """(canonical site, width of its vectors), refused where this model cannot write one vector per token."""
    act = model.resolve(site)
    if act.kind == "logits":
        raise SiteError("logits cannot be steered", code="site_not_writable",
                        remedy="steer resid_post of the last layer (the unembedding reads it)")
    axes = act.spec.axes
    if axes[0] != "pos" or len(axes) not in (2, 3) or len(axes) == 3 and axes[1] not in HEAD_AXES:
        raise SiteError(f"{act} is not one vector per token (axes {', '.join(axes)}): there is no direction to add",
                        code="steering_site_kind", remedy="steer a residual, attention/MLP output, neuron, head "
                        "(q, k, v, z, result with head: H) or feature site")
    sizes = model.axis_sizes(act)
    if len(axes) == 3:
        if head is None:
            raise SiteError(f"{act} has one vector per {axes[1].replace('_', ' ')}: say which one",
                            code="steering_head",
                            remedy=f"give head: H (0..{sizes[axes[1]] - 1})")
        if not 0 <= head < sizes[axes[1]]:
            raise SiteError(f"{act}: {axes[1]} {head} is out of range", code="site_out_of_range",
                            remedy=f"this model has {axes[1]} 0..{sizes[axes[1]] - 1}")
    elif head is not None:
        raise SiteError(f"{act} has no head axis, so head: {head} means nothing there", code="steering_head",
                        remedy="drop head, or steer a per-head site (q, k, v, z, result)")
    if act.kind != "result":
        model.hook_name(act)  # refuses what this backend cannot write
    return act, sizes[axes[-1]]


def residual_sites(model: ModelAdapter) -> list[ActName]:
    """Every point the residual stream is read: resid_pre.L, resid_mid.L (sequential blocks), last resid_post."""
    s = model.structure
    sites = []
    for layer in range(s.n_layers):
        sites.append(ActName("resid_pre", layer))
        if not s.parallel:
            sites.append(ActName("resid_mid", layer))
    sites.append(ActName("resid_post", s.n_layers - 1))
    return sites


def written_sites(model: ModelAdapter, at: str | list[str] | None, direction_site: str,
                  head: int | None, width: int) -> list[ActName]:
    """The sites the direction is written at (default: its own), each checked against its width."""
    names = [direction_site] if at is None else at if isinstance(at, list) else [at]
    sites: list[ActName] = []
    for name in names:
        if name == RESIDUAL:
            sites += residual_sites(model)
        else:
            sites.append(model.resolve(name))
    if len(set(sites)) != len(sites):
        raise SiteError(f"a site is named twice in at: {[str(s) for s in sites]}", code="steering_site_twice",
                        remedy="name each site once")
    for act in sites:
        act, site_width = steerable(model, act, head)
        if site_width != width:
            raise SiteError(f"the direction has width {width}, and {act} holds vectors of width {site_width}",
                            code="direction_width", remedy=f"make the direction at {act} (or a site of width "
                            f"{width}), or write it where it was made ({direction_site})")
    return sites


def site_notes(model: ModelAdapter, sites: list[ActName], head: int | None) -> list[str]:
    """What writing at these sites means on this model (the plan's notes)."""
    s = model.structure
    notes = []
    kinds = {a.kind for a in sites}
    if kinds & {"k", "v"} and s.group_size > 1 and head is not None:
        first = head * s.group_size
        notes.append(f"grouped-query attention: kv head {head} is read by query heads "
                     f"{first}..{first + s.group_size - 1}"
                     " (its whole group)")
    if s.parallel and kinds & {"attn_out", "mlp_out"}:
        notes.append("parallel blocks: attention and MLP both read resid_pre.L, so a write to attn_out.L / mlp_out.L "
                     "reaches the other branch of its layer only through later layers")
    if any(a.kind == "features" for a in sites):
        notes.append("feature site: the direction is added to the dictionary's features and written back as "
                     "x + (f' - f) W_dec, keeping the dictionary's error term (docs/features.md)")
    if s.parallel and any(a.kind == "resid_pre" for a in sites):
        notes.append("parallel blocks: resid_pre.L is what both attention and MLP of layer L read")
    return notes
