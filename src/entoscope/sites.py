"""Addressing activations: activation kind x layer x head x neuron x position.

`Sites` is a config (it validates and serialises like every operation config): the activation
kind, the axes that form a grid (`over`), a selection per axis, exclusions, groups of units read as
one row, or an explicit list of coordinates. `Sites.resolve(model, lengths)` checks everything
against the model and the data BEFORE any work and returns a `SiteSet` of units (one row each).

Positions: a non-negative position is that token index in every prompt; a negative one counts
from each prompt's own end (-1 = last token), which aligns prompts of different lengths; a role
(data/roles.py: `S2`, `S2+1`, `END`, `END-2`) is each prompt's own token for it. "all" positions
means every index 0..n-1 when the prompts all have n tokens, and the last (shortest length) tokens
of every prompt, counted from each end, when their lengths differ. Labels (`position_text`): an
index reads as itself (`3`), a position from the end as the END role with its offset (`END` = -1,
`END-2` = -3), a role as its name: one spelling in tables, figures and takeaways.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Union

import pandas as pd
import torch
from pydantic import Field, field_validator

from .config_model import ConfigModel
from .data.roles import END, RoleTable
from .errors import SiteError, warn
from .models.adapter import ModelAdapter
from . import naming
from .models.names import KINDS, ActName, Kind, parse_name

Selection = Union[str, int, list[Union[int, str]]]  # "all", "2:5", "-3:", 4, [0, 2, -1]; positions: "S2", "S2+1"
ROLE_BASE = 1 << 20  # a position coordinate >= ROLE_BASE names a role (data/roles.py), not a token index
ROLE_STRIDE = 1 << 10  # offsets from a role: -512..511
_ROLE_REF = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:([+-])\s*(\d+))?\s*")

_AXIS_ALIASES = {"layer": "layer", "layers": "layer", "pos": "pos", "position": "pos", "positions": "pos",
                 "head": "head", "heads": "head", "kv_head": "kv_head", "neuron": "neuron",
                 "neurons": "neuron", "feature": "feature", "features": "feature", "query_pos": "query_pos",
                 "dest": "query_pos", "dest_pos": "query_pos", "key_pos": "key_pos", "src": "key_pos", "src_pos": "key_pos", "source_pos": "key_pos"}
_SELECTION_FIELD = {"layer": "layers", "pos": "positions", "head": "heads", "kv_head": "heads",
                    "neuron": "neurons", "feature": "features", "query_pos": "query_positions",
                    "key_pos": "key_positions"}
_POSITION_AXES = ("pos", "query_pos", "key_pos")
_INNER_FIELDS = {"positions": "pos", "heads": "head", "neurons": "neuron", "features": "feature",
                 "query_positions": "query_pos", "key_positions": "key_pos"}  # selections of non-layer axes

Coord = tuple[tuple[str, int], ...]  # sorted (axis, index) pairs


def _axis(name: str) -> str:
    if name not in _AXIS_ALIASES:
        raise SiteError(f"unknown axis {name!r}", code="unknown_axis",
                        remedy=f"axes are {', '.join(sorted(set(_AXIS_ALIASES.values())))}")
    return _AXIS_ALIASES[name]


@dataclass(frozen=True)
class Unit:
    """One row of a site set: one coordinate, or a group of coordinates read together."""

    members: tuple[Coord, ...]
    label: str

    def get(self, axis: str) -> int | None:
        """The index on `axis` when every member agrees on it, else None."""
        values = {dict(m).get(axis) for m in self.members}
        return values.pop() if len(values) == 1 else None

    @property
    def is_group(self) -> bool:
        return len(self.members) > 1


@dataclass(frozen=True)
class SiteSet:
    """The resolved units of a `Sites` selection on one model (and data lengths)."""

    kind: Kind
    over: tuple[str, ...]
    units: tuple[Unit, ...]
    n_layers: int
    note: str = ""
    bases: tuple[tuple[int, str], ...] = ()  # features: (layer, dictionary key) of each layer's dictionary
    role_names: tuple[str, ...] = ()  # the roles position codes index (data/roles.py RoleTable.names)

    def __len__(self) -> int:
        return len(self.units)

    def act_name(self, layer: int | None) -> ActName:
        """The activation a unit's member at `layer` reads or writes (features: with its dictionary)."""
        if not self.kind.per_layer:
            return ActName(self.kind.name)
        return ActName(self.kind.name, layer, dict(self.bases).get(layer) if layer is not None else None)

    def layers(self) -> list[int]:
        """Every layer some unit touches, sorted."""
        out = {dict(m).get("layer") for u in self.units for m in u.members}
        return sorted(x for x in out if x is not None)

    def frame(self) -> pd.DataFrame:
        """One row per unit: a column per grid axis (None for a group whose members differ) and a label."""
        rows = []
        bases = dict(self.bases)
        by_role = any(is_role(v) or v < 0 for u in self.units for m in u.members for a, v in m
                      if a in _POSITION_AXES)  # one column of labels, as readers write them
        for u in self.units:
            row: dict[str, Any] = {"site": u.label}
            for ax in self.over:
                value = u.get(ax)
                if by_role and ax in _POSITION_AXES and value is not None:
                    value = position_text(value, self.role_names)  # one column of labels: "S2", "END-2", "3"
                row["position" if ax == "pos" else ax] = value
            if bases:
                row["dictionary"] = bases.get(u.get("layer"), None)  # type: ignore[arg-type]
            rows.append(row)
        return pd.DataFrame(rows)


class Sites(ConfigModel):
    """Which activations an operation reads or writes, as a grid, a filter, groups or a list.

    activation: a kind (resid_pre, resid_mid, resid_post, attn_out, mlp_out, z, q, k, v, pattern,
                attn_scores, result, mlp_pre, mlp_post, embed, ...), or a full name/alias with a layer
                (`blocks.5.hook_resid_post`), which then fixes `layers`.
    over:       the axes that make rows, e.g. [layer, position] or [layer, head]; axes left out are
                read whole (e.g. all of d_model), unless their selection names indices: each row then
                reads those together (over=[layer], positions=[-1]: each layer's last token).
    layers, positions, heads, neurons, query_positions, key_positions: "all", an index, a list of
                indices (negative from the end), or a range "a:b" (end exclusive, like Python).
    exclude:    coordinates to drop, e.g. [{layer: 0, head: 3}].
    groups:     rows that each read several units together, e.g. [[{layer: 9, head: 6}, {layer: 9, head: 9}]];
                given instead of the grid.
    coords:     an explicit list of single coordinates, instead of the grid.
    dictionary: read and write `activation` in a dictionary's features instead (docs/features.md): a
                dictionary (demo/resid_post.1, a SAELens folder, a registered name) or a release (demo, a
                folder of SAELens folders: each layer's member that writes the activation). The sites
                then have axes layer, position and feature; `features` selects features.
    """


    activation: str = Field(description="a kind (resid_pre, resid_post, attn_out, mlp_out, z, q, k, v, pattern, "
                            "result, ...) or a full name with a layer (blocks.5.hook_resid_post)")
    over: list[str] = Field(default_factory=lambda: ["layer"], description="the axes that make rows, e.g. [layer, "
                            "position] or [layer, head]; axes left out are read whole")
    layers: Selection = Field(default="all", description="which layers: all, an index, a list, or a range a:b "
                              "(negative: from the end)")
    positions: Selection = Field(default="all", description="which token positions: all, an index, a list, or a "
                                 "range a:b, or roles (S2, END, S2+1)")
    heads: Selection = Field(default="all", description="which heads: all, an index, a list, or a range a:b")
    neurons: Selection = Field(default="all", description="which MLP neurons: all, an index, a list, or a range a:b")
    query_positions: Selection = Field(default="all", description="pattern / attn_scores: which query positions")
    key_positions: Selection = Field(default="all", description="pattern / attn_scores: which key positions")
    exclude: list[dict[str, int]] = Field(default_factory=list, description="coordinates to drop, e.g. [{layer: 0, "
                                          "head: 3}]")
    groups: list[list[dict[str, int]]] | None = Field(default=None, description="rows that each read several units "
                                                      "together, e.g. [[{layer: 1, head: 0}, {layer: 1, head: 2}]]; "
                                                      "instead of the grid")
    coords: list[dict[str, int]] | None = Field(default=None, description="an explicit list of single coordinates, "
                                                "instead of the grid")
    dictionary: str | None = Field(default=None, description="read and write in a dictionary's features: "
                                   "demo/resid_post.1, a SAELens folder, or a release (docs/features.md)")
    features: Selection = Field(default="all", description="with a dictionary: which features, all, an index, a "
                                "list, or a range a:b")

    @field_validator("over")
    @classmethod
    def _known_axes(cls, v: list[str]) -> list[str]:
        return [_axis(a) for a in v]

    # ------------------------------------------------------------------ resolution
    def kind(self) -> tuple[Kind, int | None]:
        text = self.activation.strip()
        if text in KINDS:
            return KINDS[text], None
        act = parse_name(text)
        return KINDS[act.kind], act.layer

    def resolve(self, model: ModelAdapter, lengths: list[int] | None = None, roles: RoleTable | None = None
                ) -> SiteSet:
        """Validate against the model (and the prompts' token lengths and roles) and list the units."""
        kind, fixed_layer = self.kind()
        named = kind.name  # the activation units are named after (features: the one the dictionary reads)
        if fixed_layer is not None:  # blocks.9.hook_resid_post on a 3-layer model; final_resid = layer -1
            fixed_layer = model.resolve(ActName(kind.name, fixed_layer)).layer
        s = model.structure
        if kind.name == "features" and self.dictionary is None:
            raise SiteError("features sites need a dictionary", code="features_name",
                            remedy="give the activation the dictionary reads and writes, and the dictionary: "
                            "Sites(activation='resid_post', dictionary='demo/resid_post.1', over=['feature'])")
        if kind.name == "resid_mid" and s.parallel:
            model.resolve("resid_mid.0")  # raises the no_resid_mid refusal
        if kind.name == "pos_embed":
            model.resolve("pos_embed")
        bases: tuple[tuple[int, str], ...] = ()
        d_sae = 0
        if self.dictionary is not None:
            kind, fixed_layer, bases, d_sae = self._feature_basis(model, kind, fixed_layer)
        axes_of_kind = set(kind.axes) | ({"layer"} if kind.per_layer else set())
        if kind.name in ("k", "v"):
            axes_of_kind.add("head")  # one query head's own copy of the shared key/value head
        for ax in self.over:
            if ax not in axes_of_kind:
                valid = sorted(axes_of_kind - {"d_model", "d_head", "one", "vocab"})
                raise SiteError(f"{kind.name} has no {ax!r} axis", code="axis_not_in_activation",
                                remedy=f"{kind.name} can be split over {', '.join(valid) or 'nothing'}")
        min_len = min(lengths) if lengths else None
        sizes = {"layer": s.n_layers, "head": s.n_heads, "kv_head": s.n_kv_heads, "neuron": s.d_mlp,
                 "pos": min_len or s.n_ctx, "query_pos": min_len or s.n_ctx, "key_pos": min_len or s.n_ctx,
                 "feature": d_sae}
        if kind.name in ("k", "v") and "head" in self.over:
            sizes["head"] = s.n_heads
        note = ""
        if lengths and len(set(lengths)) > 1 and any(ax in _POSITION_AXES for ax in self.over):
            note = (f"prompts have {min(lengths)}..{max(lengths)} tokens: 'all' positions means the last {min_len} "
                    f"tokens of every prompt, counted from its end (END-{min_len - 1}..END); a non-negative "
                    "position is a token index")
        if self.coords is not None or self.groups is not None:
            raw_groups = [[c] for c in self.coords] if self.coords is not None else self.groups
            units = [self._unit([self._coord(c, sizes, fixed_layer, kind, lengths, roles) for c in g], roles, named)
                     for g in raw_groups or []]
        else:
            grid_axes = list(self.over)
            choices = [self._select(ax, sizes, lengths, roles) if not (ax == "layer" and fixed_layer is not None)
                       else [fixed_layer] for ax in grid_axes]
            # Axes left out of `over` are read whole, except where a selection names some of their indices:
            # then each row reads those together (a per-layer kind: every selected layer; positions=[-1]:
            # the last token) instead of the whole axis.
            inner = self._inner_axes(kind, axes_of_kind, fixed_layer, sizes, lengths, roles)
            excluded = self._exclusions(grid_axes + [ax for ax, _ in inner])
            units = []
            for combo in itertools.product(*choices):
                coord = dict(zip(grid_axes, combo))
                members = [tuple(sorted({**coord, **dict(zip([ax for ax, _ in inner], rest))}.items()))
                           for rest in itertools.product(*[c for _, c in inner])]
                members = [m for m in members if not any(all(dict(m).get(a) == v for a, v in ex) for ex in excluded)]
                if members:
                    units.append(self._unit(members, roles, named))
        if not units:
            raise SiteError(f"the selection of {kind.name} sites is empty", code="empty_selection",
                            remedy="widen layers/positions/heads, or drop some exclusions")
        if bases:
            used = {dict(m)["layer"] for u in units for m in u.members}
            bases = tuple((L, key) for L, key in bases if L in used)
        if roles is not None and lengths:
            warn_mixed_roles(units, lengths, roles)
        return SiteSet(kind, tuple(self.over), tuple(units), s.n_layers, note, bases,
                       roles.names if roles is not None else ())

    def _inner_axes(self, kind: Kind, axes_of_kind: set[str], fixed_layer: int | None, sizes: dict[str, int],
                    lengths: list[int] | None, roles: RoleTable | None) -> list[tuple[str, list[int]]]:
        """The axes outside `over` that each row reads only some indices of, with those indices: the layers
        of a per-layer kind, and every axis whose selection is not "all". A selection for an axis the
        activation lacks, or one that contradicts a layer fixed by the activation's name, is refused."""
        if fixed_layer is not None and self.layers != "all" and self.kind()[1] is not None:
            if self._select("layer", sizes, lengths) != [fixed_layer]:
                raise SiteError(f"layers={self.layers!r}, but activation {self.activation!r} names layer {fixed_layer}",
                                code="bad_selection", remedy="drop layers, or name the activation by its kind "
                                f"({kind.name}) and select layers")
        inner = []
        if kind.per_layer and "layer" not in self.over:
            inner.append(("layer", [fixed_layer] if fixed_layer is not None else self._select("layer", sizes, lengths)))
        for field, axis in _INNER_FIELDS.items():
            value = getattr(self, field)
            if value == "all" or axis in self.over or field == "heads" and "kv_head" in self.over:
                continue
            if axis not in axes_of_kind:
                raise SiteError(f"{field}={value!r}, but {kind.name} has no {axis} axis to select from",
                                code="axis_not_in_activation",
                                remedy=f"drop {field}" + (", or give a dictionary" if field == "features" else ""))
            inner.append((axis, self._select(axis, sizes, lengths, roles)))
        return inner

    def _exclusions(self, axes: list[str]) -> set[Coord]:
        """The exclusions as coordinates; one on an axis that rows read whole cannot be honoured: refused."""
        out = set()
        for e in self.exclude:
            ex = tuple(sorted((_axis(k), int(v)) for k, v in e.items()))
            whole = ["position" if a == "pos" else a for a, _ in ex if a not in axes]
            if whole:
                raise SiteError(f"exclude {e}: the rows read {whole[0]} whole, so there is nothing to exclude",
                                code="bad_selection", remedy=f"add {whole[0]} to over, or select its indices")
            out.add(ex)
        return out

    def _feature_basis(self, model: ModelAdapter, written: Kind, fixed_layer: int | None,
                       ) -> tuple[Kind, int | None, tuple[tuple[int, str], ...], int]:
        """features sites: (the features kind, the fixed layer, each layer's dictionary key, their width)."""
        from .models.dictionaries.catalog import for_site, get_dictionary, is_release, writers

        if not written.per_layer:
            raise SiteError(f"a dictionary on {written.name} has no layer", code="dictionary_site_unsupported",
                            remedy="use dictionaries on per-layer activations (resid_post, mlp_out, ...)")
        spec = str(self.dictionary)
        if fixed_layer is None and not is_release(spec) and self.layers == "all":
            fixed_layer = parse_name(get_dictionary(spec).hook_out).layer  # one dictionary: its layer
        layers = [fixed_layer] if fixed_layer is not None else self._select(
            "layer", {"layer": model.structure.n_layers}, None)
        if fixed_layer is None and self.layers == "all":  # a release: "all" = the layers it covers
            covered = [L for L in layers if writers(spec, f"{written.name}.{L}")]
            layers = covered or layers  # none: refused below, naming the release's members
        bases, widths = [], set()
        for L in layers:
            key, d = for_site(spec, f"{written.name}.{L}")
            model.resolve(ActName("features", L, key))  # the dictionary fits this model
            bases.append((L, key))
            widths.add(d.d_sae)
        if len(widths) > 1:
            raise SiteError(f"the dictionaries of these layers have different widths ({sorted(widths)}), so one "
                            "features grid does not fit them all", code="dictionary_widths_differ",
                            remedy="select one layer per Sites, or dictionaries of one width")
        return KINDS["features"], fixed_layer, tuple(bases), widths.pop()

    def _select(self, axis: str, sizes: dict[str, int], lengths: list[int] | None,
                roles: RoleTable | None = None) -> list[int]:
        field = _SELECTION_FIELD[axis]
        value = getattr(self, field)
        size = sizes[axis]
        if value == "all":
            if axis in _POSITION_AXES and lengths and len(set(lengths)) > 1:
                return list(range(-size, 0))  # prompts of different lengths: counted from each prompt's end
            return list(range(size))
        if axis in _POSITION_AXES and (isinstance(value, list) or isinstance(value, str) and ":" not in value):
            items = value if isinstance(value, list) else [value]
            return [self._check(axis, role_ref(v, roles, field) if isinstance(v, str) else v, sizes, lengths, roles)
                    for v in items]
        if isinstance(value, list) and any(isinstance(v, str) for v in value):
            raise SiteError(f"{field}={value!r}: names are roles, which only positions take", code="bad_selection",
                            remedy="give indices")
        if isinstance(value, str):
            m = re.fullmatch(r"\s*(-?\d*)\s*:\s*(-?\d*)\s*", value)
            if not m:
                raise SiteError(f"{field}={value!r} is not a selection", code="bad_selection",
                                remedy="use 'all', an index, a list of indices, or a range 'a:b'")
            start = int(m.group(1)) if m.group(1) else None
            stop = int(m.group(2)) if m.group(2) else None
            if axis in _POSITION_AXES:
                idx = self._position_range(field, value, start, stop, size, lengths)
            else:
                idx = self._index_range(field, value, start, stop, axis, size)
        else:
            idx = [value] if isinstance(value, int) else list(value)
        return [self._check(axis, i, sizes, lengths, roles) for i in idx]

    @staticmethod
    def _index_range(field: str, value: str, start: int | None, stop: int | None, axis: str, size: int) -> list[int]:
        """A range over layers/heads/neurons: Python's meaning, but bounds past the end are refused."""
        for bound in (start, stop):
            if bound is not None and not -size <= bound <= size:
                raise SiteError(f"{field}={value!r} reaches past the model's {size} {axis}s", code="site_out_of_range",
                                remedy=f"bounds must be in -{size}..{size}")
        return list(range(size))[slice(start, stop)]

    @staticmethod
    def _position_range(field: str, value: str, start: int | None, stop: int | None, size: int,
                        lengths: list[int] | None) -> list[int]:
        """A range of positions. Non-negative bounds are token indices; negative ones count from each
        prompt's end (so `-3:` is the last three tokens of every prompt). A bound past the shortest
        prompt is refused rather than clipped or wrapped into other tokens."""
        shortest = min(lengths) if lengths else size
        where = f"the shortest prompt ({shortest} tokens)" if lengths else f"the context ({size})"
        from_end = start is not None and start < 0
        for bound in (start, stop):
            if bound is not None and not -shortest <= bound <= shortest:
                raise SiteError(f"{field}={value!r}: {bound} is outside {where}", code="site_out_of_range",
                                remedy=f"bounds must be in -{shortest}..{shortest} (negative counts from each "
                                "prompt's end)")
        if from_end and stop is not None and stop >= 0 or not from_end and stop is not None and stop < 0:
            if lengths and len(set(lengths)) == 1:  # one length: both kinds of bound name the same tokens
                n = lengths[0]
                return list(range(n))[slice(start, stop)]
            raise SiteError(f"{field}={value!r} mixes a bound from the start with one from the end, which names "
                            "a different number of tokens in prompts of different lengths", code="bad_selection",
                            remedy="use two non-negative bounds (token indices) or two negative ones (from each "
                            "prompt's end), e.g. '-5:' or '2:6'")
        if from_end:
            idx = list(range(start, stop if stop is not None else 0))  # type: ignore[arg-type]
        else:
            idx = list(range(start or 0, stop if stop is not None else shortest))
        if not idx:
            raise SiteError(f"{field}={value!r} selects no position", code="empty_selection",
                            remedy="a range 'a:b' needs a < b")
        return idx

    def _check(self, axis: str, i: int, sizes: dict[str, int], lengths: list[int] | None,
               roles: RoleTable | None = None) -> int:
        size = sizes[axis]
        if axis in _POSITION_AXES and is_role(i):
            _check_role(i, lengths, roles)
            return i
        if axis in _POSITION_AXES:
            if lengths:
                for n, length in enumerate(lengths):
                    if not -length <= i < length:
                        raise SiteError(f"position {i} is outside prompt {n}, which has {length} tokens",
                                        code="site_out_of_range",
                                        remedy=f"positions must be in -{min(lengths)}..{min(lengths) - 1} for "
                                        "every prompt; use negative positions to count from each end")
            elif not -size <= i < size:
                raise SiteError(f"position {i} is outside the context ({size})", code="site_out_of_range",
                                remedy=f"use -{size}..{size - 1}")
            return i  # negative positions stay relative to each prompt's end
        if not -size <= i < size:
            name = {"layer": "layers", "head": "heads", "kv_head": "key/value heads", "neuron": "neurons",
                    "feature": "features in its dictionary"}[axis]
            raise SiteError(f"{axis} {i} is out of range: this model has {size} {name}",
                            code="site_out_of_range", remedy=f"use 0..{size - 1} (or negative from the end)")
        return i % size

    def _coord(self, raw: dict[str, Any], sizes: dict[str, int], fixed_layer: int | None, kind: Kind,
               lengths: list[int] | None, roles: RoleTable | None = None) -> Coord:
        coord = {_axis(k): role_ref(v, roles, k) if isinstance(v, str) and _axis(k) in _POSITION_AXES else int(v)
                 for k, v in raw.items()}
        if fixed_layer is not None:
            coord.setdefault("layer", fixed_layer)
        if kind.per_layer and "layer" not in coord:
            raise SiteError(f"coordinate {raw} has no layer", code="coordinate_incomplete",
                            remedy="give a layer in each coordinate, e.g. {layer: 9, head: 6}")
        for ax in coord:
            if ax not in sizes:
                raise SiteError(f"unknown axis {ax!r} in {raw}", code="unknown_axis",
                                remedy="axes are layer, pos, head, kv_head, neuron, query_pos, key_pos")
            if ax != "layer" and ax not in kind.axes and not (ax == "head" and kind.name in ("k", "v")):
                raise SiteError(f"{kind.name} has no {ax!r} axis (in {raw})", code="axis_not_in_activation",
                                remedy=f"{kind.name} has axes {', '.join(kind.axes)}")
        return tuple(sorted((ax, self._check(ax, i, sizes, lengths, roles)) for ax, i in coord.items()))

    @staticmethod
    def _unit(members: list[Coord], roles: RoleTable | None = None, kind: str = "") -> Unit:
        names = roles.names if roles is not None else ()
        return Unit(tuple(members), "+".join(_label(m, names, kind) for m in members))


def _label(coord: Coord, role_names: tuple[str, ...] = (), kind: str = "") -> str:
    """A unit's name in the one naming scheme (naming.py): a2.h0, m1, resid_pre.2@S1, resid_post.1.f256@END."""
    d: dict[str, Any] = dict(coord)
    for ax in _POSITION_AXES:
        if ax in d:
            d[ax] = position_text(d[ax], role_names)
    return naming.site(kind, d) if d or kind else "all"


def role_code(index: int, offset: int = 0) -> int:
    if not -ROLE_STRIDE // 2 <= offset < ROLE_STRIDE // 2:
        raise SiteError(f"offset {offset} from a role is too large", code="bad_selection", remedy="use -512..511")
    return ROLE_BASE + index * ROLE_STRIDE + offset + ROLE_STRIDE // 2


def is_role(position: int) -> bool:
    return position >= ROLE_BASE


def decode_role(code: int) -> tuple[int, int]:
    """(role index, offset) of a role position code."""
    k = code - ROLE_BASE
    return k // ROLE_STRIDE, k % ROLE_STRIDE - ROLE_STRIDE // 2


def position_text(position: int, role_names: tuple[str, ...] = ()) -> str:
    """A position as a reader writes it: `3` (a token index), `END`, `END-1` (-1, -2: from each prompt's
    end, the END role's spelling), `S2`, `S2+1` (roles)."""
    if position < 0:
        return END + (f"{position + 1:+d}" if position != -1 else "")
    if not is_role(position):
        return str(position)
    index, offset = decode_role(position)
    name = role_names[index] if index < len(role_names) else f"role{index}"
    return name + (f"{offset:+d}" if offset else "")


def role_ref(text: str, roles: RoleTable | None, field: str) -> int:
    """The code of a role reference `S2`, `S2+1`, `END-2` (refused where the data has no such role)."""
    m = _ROLE_REF.fullmatch(text)
    if not m:
        raise SiteError(f"{field}={text!r} is neither a position, a range nor a role", code="bad_selection",
                        remedy="use an index, a range 'a:b', or a role of the data (S2, END, S2+1)")
    known = roles.names if roles is not None else ("END",)
    if m.group(1) not in known:
        raise SiteError(f"{field}: no role {m.group(1)!r} in this data", code="role_unknown",
                        remedy=f"this data's roles: {', '.join(known)} (mark roles in prompts with [[NAME:text]] "
                        "or give a roles field; docs/statistics.md)")
    if roles is None:
        raise SiteError(f"{field}: role positions need the data's roles, which this operation does not have",
                        code="role_unknown", remedy="use token indices here")
    offset = int(m.group(3) or 0) * (-1 if m.group(2) == "-" else 1)
    return role_code(roles.index(m.group(1)), offset)


def _check_role(code: int, lengths: list[int] | None, roles: RoleTable | None) -> None:
    if roles is None or lengths is None:
        return
    index, offset = decode_role(code)
    pos = roles.positions[:, index]
    name = position_text(code, roles.names)
    missing = (pos < 0).nonzero().flatten()
    if len(missing):
        raise SiteError(f"role {roles.names[index]} is missing in {len(missing)} of {len(pos)} prompts (first: prompt "
                        f"{int(missing[0])})", code="role_missing",
                        remedy="mark the role in every prompt, or drop the prompts without it")
    at = pos + offset
    bad = ((at < 0) | (at >= torch.tensor(lengths))).nonzero().flatten()
    if len(bad):
        e = int(bad[0])
        raise SiteError(f"position {name} is token {int(at[e])} of prompt {e}, which has {lengths[e]} tokens",
                        code="site_out_of_range", remedy="use a smaller offset from the role")


def resolve_positions(codes: torch.Tensor, lengths: torch.Tensor, roles: torch.Tensor | None = None) -> torch.Tensor:
    """Absolute token index of position codes, per prompt: codes and lengths [N], roles [N, R] (the prompts'
    RoleTable rows). Non-negative: the index; negative: from the prompt's end; a role code: the role's token."""
    out = torch.where(codes < 0, codes + lengths, codes)
    role = codes >= ROLE_BASE
    if bool(role.any()):
        if roles is None:
            raise SiteError("a role position without the prompts' roles", code="role_unknown",
                            remedy="this operation cannot read role positions")
        k = (codes - ROLE_BASE).clamp(min=0)
        index, offset = k // ROLE_STRIDE, k % ROLE_STRIDE - ROLE_STRIDE // 2
        at = roles.to(codes.device).gather(-1, index.clamp(max=roles.shape[-1] - 1)[..., None])[..., 0] + offset
        out = torch.where(role, at, out)
    return out


def absolute_positions(position: int, lengths: torch.Tensor, roles: torch.Tensor | None = None) -> torch.Tensor:
    """Per-prompt token index of a (possibly negative, or role) position: [batch] long tensor."""
    return resolve_positions(torch.full_like(lengths, position), lengths, roles)


def warn_mixed_roles(units: list[Unit], lengths: list[int], roles: RoleTable) -> None:
    """Warn, once for all of them, about the numeric positions that hold tokens of different roles in
    different prompts (with the counts of the first few)."""
    if not roles.has_named_roles:
        return
    numeric = sorted({v for u in units for m in u.members for a, v in m if a in _POSITION_AXES and not is_role(v)},
                     key=lambda p: (p < 0, p))
    if not numeric:
        return
    L = torch.tensor(lengths)
    at = torch.stack([absolute_positions(p, L) for p in numeric])  # [P, E] token index of each position
    hit = roles.positions[None, :, :] == at[:, :, None]  # [P, E, R]
    first = torch.where(hit.any(-1), hit.int().argmax(-1), -1)  # the role of each prompt's token, -1: none
    mixed = []
    for i, p in enumerate(numeric):
        kinds, counts = first[i].unique(return_counts=True)
        if len(kinds) > 1:
            what = ", ".join(f"{'role ' + roles.names[int(k)] if k >= 0 else 'no role'} in {int(c)}"
                             for k, c in sorted(zip(kinds.tolist(), counts.tolist()), key=lambda kc: -kc[1]))
            mixed.append(f"{position_text(p)}: {what}")
    if mixed:
        shown = "; ".join(mixed[:3]) + ("; ..." if len(mixed) > 3 else "")
        warn(f"{len(mixed)} of {len(numeric)} positions hold tokens of different roles across the {len(lengths)} "
             f"prompts ({shown}): those columns mix different tokens. Name roles instead, e.g. positions: "
             f"[{', '.join(roles.names)}]", code="position_roles_differ")
