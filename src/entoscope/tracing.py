"""`es.trace(model, prompts, sites)`: activations by entoscope's site names, as tensors, on every kind of model.

    tr = es.trace(model, ["When Mary and John went to the store, John gave a drink to"], ["resid_post.*", "pattern.1"])
    tr["resid_post.1"]                  # [batch, pos, d_model], right-padded; tr.lengths [batch]
    tr.per_prompt("pattern.1")          # one [head, query_pos, key_pos] tensor per prompt, cut to its length
    tr.at("resid_post.1", "END")        # [batch, d_model]: each prompt's own last token (or a role: S2, IO+1)
    tr.to_activation_cache()            # a TransformerLens ActivationCache (bridge, HookedTransformer)

What `sites` takes: a canonical name (`resid_post.3`, `z.2`, `pattern.5`, `embed`, `logits`, a feature site
`features.1@demo/resid_post.1`), an alias (`blocks.3.hook_resid_post`, `layers_output[3]`, `final_resid`), a
glob over this model's canonical names (`resid_post.*`, `*.0`, `attn_*.1`; `*` and `?` as in fnmatch), a
`Sites` config (its activation, whole, at every layer it selects; with a dictionary, its features), or a list
of these. Every name is checked against the model before the first forward.

What comes back: a `Trace`, a read-only mapping from canonical name to a tensor in the kind's canonical layout
(models/names.py: batch first, then e.g. pos, d_model; pattern: head, query_pos, key_pos), prompts in the order
given and right-padded to the longest: pad positions (on every position axis) hold 0, and -inf in attn_scores
(as the causal mask leaves keys past a prompt's end). `lengths`, `mask` and `per_prompt` say which positions are
real. Each value equals a one-prompt run of the backend's own forward (right padding with no attention mask
is exact for causal models; tested against run_with_cache and nnsight's own reads).

The forwards are entoscope's reads (`ModelAdapter.run`): batches grouped by length, through the runner's
`run_with_cache`, so a `CachedModel` serves a trace it has seen from disk; a run that reads no logits stops
after the last block it needs. Feature sites are read by encoding the dictionary's input (models/features.py).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .data.examples import Dataset, Example
from .data.loading import load_data
from .data.roles import RoleTable
from .data.tokenized import length_batches, pad, pad_id, tokenize_data
from .errors import DataError, EntoscopeError, SiteError, UnknownNameError
from .models.adapter import ModelAdapter, adapt
from .models.names import KINDS, ActName
from .sites import Sites, _check_role, absolute_positions, role_ref

POSITION_AXES = ("pos", "query_pos", "key_pos")
GLOB = ("*", "?")


def model_names(model: ModelAdapter) -> list[ActName]:
    """Every canonical activation this model serves (no features: those name a dictionary), model-level inputs
    first, then layer by layer in the order of names.KINDS, then the final scale and the logits."""
    kinds = [k for k in KINDS.values() if k.name != "features"]
    first = [ActName(k.name) for k in kinds if not k.per_layer and k.name in ("embed", "pos_embed")]
    layers = [ActName(k.name, L) for L in range(model.structure.n_layers) for k in kinds if k.per_layer]
    last = [ActName(k.name) for k in kinds if not k.per_layer and k.name not in ("embed", "pos_embed")]
    out = []
    for act in first + layers + last:
        try:
            model.resolve(act)
        except EntoscopeError:
            continue
        out.append(act)
    return out


def resolve_sites(model: ModelAdapter, sites: Any) -> list[ActName]:
    """The activations `sites` names on this model, each once, in the order given (globs in model order)."""
    items = [sites] if isinstance(sites, (str, ActName, Sites)) else list(sites) if isinstance(sites, Sequence) else None
    if not items:
        raise SiteError(f"trace needs sites to read, not {sites!r:.60}", code="empty_selection",
                        remedy='name them: sites=["resid_post.*", "pattern.1", "z.0"] (docs/trace.md)')
    out: dict[ActName, None] = {}
    everything: list[ActName] | None = None
    for item in items:
        if isinstance(item, Sites):
            siteset = item.resolve(model)
            for layer in siteset.layers() or [None]:
                out[model.resolve(siteset.act_name(layer))] = None
        elif isinstance(item, str) and any(c in item for c in GLOB) and "@" not in item:
            everything = model_names(model) if everything is None else everything
            hits = [a for a in everything if fnmatch.fnmatchcase(str(a), item.strip())]
            if not hits:
                raise SiteError(f"{item!r} matches none of this model's sites", code="no_matching_sites",
                                remedy="globs match canonical names: resid_post.*, *.0, attn_*.1 (this model: "
                                f"{', '.join(sorted({a.kind for a in everything}))})")
            out.update(dict.fromkeys(hits))
        elif isinstance(item, (str, ActName)):
            try:
                out[model.resolve(item)] = None
            except UnknownNameError as err:
                if err.code != "layer_missing":
                    raise
                raise UnknownNameError(err.message, code=err.code,
                                       remedy=f"{err.remedy}, or {str(item).strip()}.* for every layer") from None
        else:
            raise SiteError(f"a site is a name, a glob or a Sites config, not {item!r:.60}", code="site_invalid",
                            remedy='e.g. "resid_post.3", "pattern.*", es.Sites(activation="z")')
    return list(out)


def _prompts(model: ModelAdapter, prompts: Any) -> Dataset:
    """The prompts as a Dataset: anything `load_data` takes, or a tensor of token ids ([pos] or [batch, pos],
    used as given: no BOS added)."""
    if isinstance(prompts, Tensor):
        rows = prompts[None] if prompts.ndim == 1 else prompts
        if rows.ndim != 2 or rows.is_floating_point() or rows.is_complex():
            raise DataError(f"token ids are a [batch, pos] tensor of integers, not {tuple(prompts.shape)} "
                            f"{prompts.dtype}", code="prompt_invalid", remedy="pass model.to_tokens(...) or strings")
        return Dataset("tokens", tuple(Example(tuple(int(t) for t in r)) for r in rows.tolist()))
    return load_data(prompts, tokenizer=model.tokenizer)


def _fill(act: ActName) -> float:
    return float("-inf") if act.kind == "attn_scores" else 0.0


def _axes(act: ActName) -> tuple[str, ...]:
    return KINDS[act.kind].axes


def _pos_mask(act: ActName, shape: Sequence[int], lengths: Tensor) -> Tensor:
    """[batch, ...] bool, True where every position axis of `act` is inside its prompt (broadcastable to shape)."""
    mask = torch.ones([len(lengths)] + [1] * (len(shape) - 1), dtype=torch.bool, device=lengths.device)
    for i, axis in enumerate(_axes(act), start=1):
        if axis in POSITION_AXES:
            index = torch.arange(shape[i], device=lengths.device).view([1] * i + [-1] + [1] * (len(shape) - i - 1))
            mask = mask & (index < lengths.view([-1] + [1] * (len(shape) - 1)))
    return mask


def trace(model: Any, prompts: Any, sites: Any, *, batch_size: int = 16, prepend_bos: bool = True,
          device: str | torch.device | None = None) -> Trace:
    """Activations of `prompts` at `sites` (module docstring; docs/trace.md).

    model:       a TransformerBridge (plain or compat), a HookedTransformer, an nnsight LanguageModel, or any
                 of them in `CachedModel` (then served from its cache where this call was made before).
    prompts:     a prompt, a list of prompts (texts, token-id lists, records), a Dataset, a data spec
                 ({task: ioi, n: 8}), or a tensor of token ids [batch, pos] (used as given). A text gets the
                 BOS token first (prepend_bos, as TransformerLens's to_tokens); a dataset's counterfactuals are
                 not run.
    sites:       names, aliases, globs or a Sites config (module docstring).
    batch_size:  prompts per forward (grouped by length; the values do not depend on it).
    device:      where the returned tensors are kept (default: where the model ran).
    """
    adapter = adapt(model)
    acts = resolve_sites(adapter, sites)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DataError(f"batch_size must be a positive integer, not {batch_size!r}", code="bad_batch_size",
                        remedy="use batch_size >= 1")
    data = _prompts(adapter, prompts)
    td = tokenize_data(adapter, data, prepend_bos=prepend_bos)
    lengths = torch.tensor(td.lengths, dtype=torch.long)
    width = int(lengths.max())
    tokens, _ = pad(td.prompts, pad_id(adapter))
    want_logits = ActName("logits") in acts
    reads = [a for a in acts if a.kind != "logits"]
    out: dict[ActName, Tensor] = {}
    for rows in length_batches(td.lengths, batch_size):
        t = int(lengths[rows].max())
        run = adapter.run(tokens[rows, :t], reads, logits=want_logits)
        got = dict(run.acts)
        if want_logits:
            assert run.logits is not None
            got[ActName("logits")] = run.logits
        for act, value in got.items():
            value = value.detach().to(device) if device is not None else value.detach()
            if act not in out:
                shape = [len(lengths)] + [width if ax in POSITION_AXES else value.shape[i + 1]
                                          for i, ax in enumerate(_axes(act))]
                out[act] = torch.full(shape, _fill(act), dtype=value.dtype, device=value.device)
            index = (torch.tensor(rows, device=value.device),) + tuple(
                slice(0, t) if ax in POSITION_AXES else slice(None) for ax in _axes(act))
            out[act][index] = value
    for act, value in out.items():  # positions past each prompt's own end (inside its batch's width too)
        value.masked_fill_(~_pos_mask(act, value.shape, lengths.to(value.device)), _fill(act))
    return Trace({a: out[a] for a in acts}, tokens, lengths, data, td.roles, adapter)


class Trace(Mapping[str, Tensor]):
    """What `trace` read: canonical name -> tensor [batch, ...], right-padded (module docstring).

    tokens [batch, pos] (the pad id past each prompt's end), lengths [batch], data (the prompts as a Dataset),
    roles (each prompt's role positions: data/roles.py). Names are looked up as the model resolves them, so
    `tr["blocks.1.hook_resid_post"]` is `tr["resid_post.1"]`."""

    def __init__(self, acts: dict[ActName, Tensor], tokens: Tensor, lengths: Tensor, data: Dataset,
                 roles: RoleTable | None, model: ModelAdapter) -> None:
        self._acts = {str(a): t for a, t in acts.items()}
        self._names = {str(a): a for a in acts}
        self.tokens = tokens
        self.lengths = lengths
        self.data = data
        self.roles = roles
        self.model = model

    # ---------------------------------------------------------------- the mapping
    def _key(self, name: Any) -> str:
        if isinstance(name, str) and name in self._acts:
            return name
        try:
            key = str(self.model.resolve(name))
        except EntoscopeError as err:
            raise UnknownNameError(f"{name!r}: {err.message}", code="site_not_traced",
                                   remedy=f"this trace read {', '.join(self._acts)}") from None
        if key not in self._acts:
            raise UnknownNameError(f"{name!r} ({key}) was not read by this trace", code="site_not_traced",
                                   remedy=f"this trace read {', '.join(self._acts)}; trace again with it in sites")
        return key

    def __getitem__(self, name: Any) -> Tensor:
        return self._acts[self._key(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._acts)

    def __len__(self) -> int:
        return len(self._acts)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in list(self._acts.items())[:6])
        more = f", ... ({len(self._acts)} sites)" if len(self._acts) > 6 else ""
        return f"Trace({len(self.lengths)} prompts, {{{shapes}{more}}})"

    # ---------------------------------------------------------------- positions
    @property
    def mask(self) -> Tensor:
        """[batch, pos] bool: True at each prompt's real tokens."""
        return torch.arange(self.tokens.shape[1])[None] < self.lengths[:, None]

    def per_prompt(self, name: Any) -> list[Tensor]:
        """One tensor per prompt, every position axis cut to the prompt's own length (no batch axis)."""
        key = self._key(name)
        axes = _axes(self._names[key])
        out = []
        for i, n in enumerate(self.lengths.tolist()):
            index = tuple(slice(0, n) if ax in POSITION_AXES else slice(None) for ax in axes)
            out.append(self._acts[key][(i,) + index])
        return out

    def prompt(self, i: int) -> dict[str, Tensor]:
        """Every site of prompt i, cut to its length."""
        return {name: self.per_prompt(name)[i] for name in self._acts}

    def positions(self, position: int | str) -> Tensor:
        """Each prompt's token index [batch] for a position: an index, a negative index (from each prompt's own
        end: -1 is its last token), or a role of the data (END, S2, IO+1, END-2)."""
        if isinstance(position, str) and position.strip().lstrip("-").isdigit():
            position = int(position)
        if isinstance(position, bool) or not isinstance(position, (int, str)):
            raise SiteError(f"a position is an index or a role, not {position!r:.40}", code="bad_selection",
                            remedy="e.g. -1, 3, 'END', 'S2', 'IO+1'")
        lengths = self.lengths
        if isinstance(position, str):
            code = role_ref(position, self.roles, "position")
            _check_role(code, lengths.tolist(), self.roles)
            return absolute_positions(code, lengths, None if self.roles is None else self.roles.positions)
        at = absolute_positions(position, lengths)
        bad = ((at < 0) | (at >= lengths)).nonzero().flatten()
        if len(bad):
            e = int(bad[0])
            raise SiteError(f"position {position} is outside prompt {e}, which has {int(lengths[e])} tokens",
                            code="site_out_of_range", remedy="use a position every prompt has (negative: from each end)")
        return at

    def at(self, name: Any, position: int | str) -> Tensor:
        """`name` at one position of each prompt ([batch, ...] without the first position axis: pattern and
        attn_scores give each prompt's query row [batch, head, key_pos])."""
        key = self._key(name)
        value = self._acts[key]
        axes = _axes(self._names[key])
        pos_axis = next((i for i, ax in enumerate(axes, start=1) if ax in POSITION_AXES), None)
        if pos_axis is None:
            raise SiteError(f"{key} has no position axis", code="axis_not_in_activation", remedy="read it whole")
        at = self.positions(position).to(value.device)
        rows = torch.arange(len(at), device=value.device)
        return value.movedim(pos_axis, 1)[rows, at]

    def str_tokens(self, i: int) -> list[str]:
        """Prompt i's tokens as text."""
        return self.model.token_strs(self.tokens[i, : int(self.lengths[i])].tolist())

    # ---------------------------------------------------------------- TransformerLens
    def to_activation_cache(self, names: Sequence[Any] | None = None) -> Any:
        """A TransformerLens `ActivationCache` of these tensors (or of `names`), keyed by the model's own hook
        names (`resid_post.3` -> `blocks.3.hook_resid_post`; `result.L` -> `blocks.L.attn.hook_result`), padded as
        here. A bridge or HookedTransformer only: an nnsight model has no hook names (refused,
        `activation_cache_unavailable`); logits and feature sites have no hook (refused, `no_hook_name`)."""
        keys = list(self._acts) if names is None else [self._key(n) for n in names]
        return self.model.backend.activation_cache({self._names[k]: self._acts[k] for k in keys})
