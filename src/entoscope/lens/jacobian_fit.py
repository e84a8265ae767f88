"""Fitting the Jacobian lens over a dataset of texts: a sharded operation (docs/lens.md, docs/scale.md).

The estimator is TransformerLens 4.3's (`JacobianLens.fit`, after Gurnee et al. 2026): for each prompt
of at most `max_length` tokens and each source layer l, row i of the prompt's matrix is

    (1/|V|) sum_{t in V} d (sum_{t' in V} h_final[t', i]) / d h_l[t]

with V = positions skip_first .. len-2 (the first `skip_first` and the last skipped); prompts are
averaged with equal weight. Causal attention makes a cotangent planted at every target position give,
at source t, exactly the sum over targets t' >= t. How it is computed here: per batch of prompts ONE
forward of `dim_chunk` copies of each prompt with the graph rooted at the earliest source block's output
(weights frozen), copy k carrying the one-hot cotangent of output dimension start + k, then plain
`torch.autograd.grad` calls (ceil(d_model / dim_chunk) per batch); TransformerLens does the same per prompt
(`dim_batch` copies) over every position. Copies rather than one forward with batched cotangents
(`is_grads_batched`, vmap): at SmolLM2's size vmap's batching rules (copies before each attention matmul,
per-row loops where an op has none) cost more than the forward of the copies saves (bench_jacobian_lens.py).
Three savings leave the numbers as they are (to float32 rounding): positions before skip_first are neither
sources nor targets and (causal attention) receive no gradient that reaches one, so where the model can
start part-way (models/partial.py) the graph holds positions skip_first.. only, attending to the earlier ones
through a frozen key/value prefix; elementwise activation modules backpropagate as one multiply by their
derivative (lens/pointwise.py) and RMS norms by their closed-form vector-Jacobian product (lens/normfold.py)
instead of replaying a formula's chain of ops on every backward call. At real sizes the backward's matrix
products are most of the time, and the positions left out are the saving that remains (docs/speed.md).

Shards return float64 sums of their prompts' matrices, split by the prompt's index parity (even / odd);
the merge adds them in shard order and divides by the prompt count once, so a sharded fit equals the
single-process one to float32 rounding (bit for bit with one batch per shard). The settledness of J[l]
is ||J_even - J_odd||_F / ||J||_F, the relative change between the two halves of the prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from pydantic import Field
from torch import Tensor

from ..data.examples import Dataset
from ..data.tokenized import Batch, length_batches, pad, pad_id
from ..errors import ConfigError, DataError, warn
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt
from ..models.footprint import FIXED
from ..models.adapter import Intervention, ModelAdapter
from ..models.names import ActName
from ..models.partial import prefix_reads, prefix_support, record_past, slice_start
from ..operation import Operation, Plan, Prepared, progress, register_operation
from ..results.result import Result
from .jacobian import ESTIMATOR, JacobianLens, _revision, prompt_hash
from .normfold import folded_norms
from .pointwise import folded_activations


ROWS_PER_BACKWARD = 32  # prompt copies (prompts x dim_chunk) in one backward call, unless batch_size says otherwise


@dataclass(frozen=True)
class FitState:
    """What the fit's prepare resolved: the kept prompts' batches, the layers, the cotangents per backward."""

    batches: list[Batch]
    layers: list[int]
    dim_chunk: int
    max_length: int
    corpus: str
    prompt_hashes: tuple[int, ...] = ()  # each kept prompt's (lens/jacobian.py: merges refuse shared prompts)


@register_operation
class JacobianLensFit(Sharded, Operation):
    """Fit a Jacobian lens (Gurnee et al. 2026) over texts; `result.extra["lens"]` is the `JacobianLens`.

    layers:     source layers (block outputs, resid_post.l); default every layer but the last.
    skip_first: leading positions left out of the average (attention sinks; TransformerLens's default 16).
    max_length: prompts are cut to this many tokens (and to the model's context).
    dim_chunk:  copies of each prompt per backward call, each carrying one one-hot cotangent; default 8 (fewer
                where the memory budget says so); the default batch holds at most 32 / dim_chunk prompts.
    corpus:     the provenance name recorded in the lens (a merge refuses lenses whose names differ);
                default the dataset's name and parameters.
    save:       where to write the lens (a .pt file, or a folder that gets lens.pt), for YAML and the CLI.
    """

    name = "jacobian_lens_fit"
    layers: list[int] | None = Field(default=None, description="source layers (block outputs resid_post.l); default "
                                     "every layer but the last")
    skip_first: int = Field(default=16, ge=0, description="leading positions left out of the average (attention "
                            "sinks; TransformerLens's default 16)")
    max_length: int = Field(default=128, ge=2, description="prompts are cut to this many tokens (and to the model's "
                            "context)")
    dim_chunk: int | None = Field(default=None, ge=1, description="copies of each prompt (one one-hot cotangent each) per backward; default "
                                  "8 (fewer where the memory budget says so)")
    corpus: str | None = Field(default=None, description="the provenance name the lens records (a merge refuses "
                               "lenses whose names differ); default the data's name and parameters")
    save: str | None = Field(default=None, description="where to write the lens: a .pt file, or a folder that gets "
                             "lens.pt (for YAML and the CLI)")

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[FitState]:
        assert data is not None
        s = model.structure
        if s.n_layers < 2:
            raise ConfigError("a one-layer model has no layer before its last to transport", code="jacobian_layers",
                              remedy="use the logit lens on this model")
        chosen = range(s.n_layers - 1) if self.layers is None else self.layers  # [] is refused, not "every layer"
        layers = sorted({L + s.n_layers if L < 0 else L for L in chosen})
        if not layers:
            raise ConfigError("layers is empty: there is no source layer to fit", code="jacobian_layers",
                              remedy=f"name source layers in 0..{s.n_layers - 2}, or leave layers out for every one")
        if layers[0] < 0 or layers[-1] >= s.n_layers - 1:
            raise ConfigError(f"layers {self.layers} must lie in 0..{s.n_layers - 2} (the last block is the target)",
                              code="jacobian_layers", remedy=f"pick source layers in 0..{s.n_layers - 2}")
        max_length = min(self.max_length, s.n_ctx)
        ids = [model.tokenize(ex.prompt, prepend_bos=self.prepend_bos)[:max_length] for ex in data]
        kept = [i for i, t in enumerate(ids) if len(t) > self.skip_first + 1]
        if not kept:
            raise DataError(f"every prompt is {max(map(len, ids), default=0)} tokens or fewer after cutting to "
                            f"{max_length}; the fit needs more than skip_first + 1 = {self.skip_first + 1}",
                            code="jacobian_prompts_too_short",
                            remedy="use longer texts (e.g. {task: corpus}), or a smaller skip_first")
        if len(kept) < len(ids):
            warn(f"{len(ids) - len(kept)} of {len(ids)} prompts have at most skip_first + 1 = {self.skip_first + 1} "
                 "tokens and are left out of the fit", code="jacobian_prompt_short")
        kept_data = Dataset(data.name, tuple(data[i] for i in kept), data.description, data.params)
        ids = [ids[i] for i in kept]
        T = max(map(len, ids))
        suffix = self.skip_first > 0 and prefix_support(model) == "positions"
        # memory: per copy of a prompt, its saved forward over the graph (fit_bytes_per_copy)
        per_cot = fit_bytes_per_copy(s, T - 1, self.skip_first if suffix else 0, layers)
        budget = self.budget_bytes
        # default 8 copies per prompt and at most 32 prompt copies per backward: wider backwards measured
        # slower on one CPU thread (their gradients outgrow the cache; bench_jacobian_lens.py)
        mats = 2 * len(layers) * s.d_model ** 2 * 8  # the even and odd prompts' float64 sums
        fixed = FIXED + 2 * mats
        chunk = self.dim_chunk or max(1, min(8, s.d_model, (budget - fixed) // per_cot))  # one prompt's copies fit
        chunk = min(chunk, s.d_model)
        n_chunks = -(-s.d_model // chunk)
        chunk = -(-s.d_model // n_chunks)  # equal chunks
        bs = self.choose_batch_size(chunk * per_cot, len(ids), cap=max(1, ROWS_PER_BACKWARD // chunk), fixed=fixed)
        batches = []
        for idx in length_batches([len(t) for t in ids], bs):
            tokens, lens = pad([ids[i] for i in idx], pad_id(model))
            batches.append(Batch(idx, tokens, lens))
        corpus = self.corpus or _corpus_name(data)
        # per prompt: the graph's run of `chunk` copies, and with the frozen prefix a run without gradients
        # before it (of the prompt itself); a bridge also walks the blocks once more to record their keys and
        # values (record_past)
        passes = chunk if not suffix else chunk + (2 if model.structure.backend == "bridge" else 1)
        notes = [f"each backward runs {chunk} copies of each prompt, copy k carrying the one-hot cotangent of "
                 f"output dimension k of its chunk: {s.d_model} vector-Jacobian products per prompt "
                 f"({n_chunks} backward calls per batch)",
                 f"positions {self.skip_first}.. and each prompt's last left out of the average",
                 f"the backward graph holds positions {self.skip_first}.. only (a frozen key/value prefix"
                 f" recorded without gradients: {passes} prompt passes per prompt)"
                 if suffix else
                 "the backward graph holds every position (this model cannot start part-way at a position)"]
        if max_length < self.max_length:
            notes.append(f"max_length cut to the model's context, {max_length}")
        plan = Plan(self.name, rows=len(layers), forward_passes=len(ids) * passes,
                    backward_passes=len(ids) * n_chunks * chunk,
                    batch_sizes=[len(b) for b in batches], examples=len(ids), files=[],
                    peak_memory_bytes=fixed + bs * chunk * per_cot, notes=notes)
        return Prepared(model, kept_data, plan, FitState(batches, layers, chunk, max_length, corpus,
                                                         tuple(prompt_hash(t) for t in ids)))

    def execute_shard(self, prepared: Prepared[FitState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        model, st = prepared.model, prepared.state
        d = model.structure.d_model
        total = {k: np.zeros((len(st.layers), d, d)) for k in ("even", "odd")}
        mine = [st.batches[i] for i in batches]
        counts = []
        with frozen(model.module), folded_activations(model.module), folded_norms(model.module):
            for b in progress(mine, total=len(mine), desc="Jacobian lens", quiet=quiet):
                per_prompt = prompt_jacobians(model, b.tokens, b.lengths, st.layers, self.skip_first, st.dim_chunk)
                parity = torch.tensor(b.index) % 2
                for key, mask in (("even", parity == 0), ("odd", parity == 1)):  # batch sums, then added in order
                    total[key] += per_prompt[mask].double().sum(0).numpy()
                counts += (b.lengths - 1 - self.skip_first).tolist()
        return PerPrompt([i for b in mine for i in b.index], {"positions": np.asarray(counts, dtype=np.int64)},
                         sums=total)

    def summarise(self, prepared: Prepared[FitState], merged: dict[str, Any], *, quiet: bool = False) -> Result:
        model, st = prepared.model, prepared.state
        cols = merged["main"]
        n = cols.n
        idx = np.arange(n)
        n_even, n_odd = int((idx % 2 == 0).sum()), int((idx % 2 == 1).sum())
        even, odd = torch.from_numpy(cols["even"]), torch.from_numpy(cols["odd"])
        mean = (even + odd) / n
        eye = torch.eye(model.structure.d_model, dtype=torch.float64)
        rows = []
        settled = {}
        for i, L in enumerate(st.layers):
            norm = float(mean[i].norm())
            change = float((even[i] / n_even - odd[i] / n_odd).norm() / norm) if n_odd and norm > 0 else float("nan")
            settled[L] = change
            rows.append({"layer": L, "n_prompts": n, "positions": int(cols.read(0, n, ["positions"])["positions"].sum()),
                         "norm": norm, "identity_distance": float((mean[i] - eye).norm() / eye.norm()),
                         "split_half_change": change})
        lens = JacobianLens({L: mean[i].float() for i, L in enumerate(st.layers)}, n_prompts=n,
                            d_model=model.structure.d_model, metadata=fit_metadata(model, self, st, n),
                            settledness=settled, prompt_hashes=torch.tensor(st.prompt_hashes, dtype=torch.int64))
        table = pd.DataFrame(rows)
        if self.save:
            lens.save(self.save)
        return Result(self.name, table, title="Jacobian lens fit: how far each layer's transport is from the "
                      "identity and how settled it is", extra={"lens": lens}, takeaway=_takeaway)


def fit_bytes_per_copy(s: Any, T: int, first: int, layers: list[int]) -> int:
    """What one copy of a prompt of T positions holds at the fit's peak (models/footprint.py's sizes, in float32):
    what autograd saves in blocks layers[0]+1.. (the graph's; the blocks before its root run without it) at
    positions first.. (each attending to T keys), and the gradients of the sources. Per block and position,
    with the weights frozen and the activations and RMS norms folded (lens/pointwise.py, lens/normfold.py): the
    norms' and products' inputs (8 d_model), the MLP's (3 d_mlp), q, k and v and the keys and values expanded
    per query head (2 q/k/v widths), the post-norms' (4 d_model), the q/k norms' inputs and outputs (2 q and k
    widths), and each head's attention weights and their softmax (2 x T); checked against
    `saved_tensors_hooks` and the measured peak on SmolLM2 and Gemma 3 (tests/test_memory_budget.py)."""
    Tg, blocks = max(1, T - first), s.n_layers - 1 - layers[0]
    q, kv = s.n_heads * s.d_head, s.n_kv_heads * s.d_head
    floats = (8 * s.d_model + 3 * s.d_mlp + 2 * (q + 2 * kv) + (4 * s.d_model if s.post_norms else 0)
              + (2 * (q + kv) if s.qk_norm else 0) + 2 * s.n_heads * T)
    return 4 * Tg * (blocks * floats + s.d_model * (len(layers) + 1))


def prompt_jacobians(model: ModelAdapter, tokens: Tensor, lengths: Tensor, layers: list[int], skip_first: int,
                     dim_chunk: int) -> Tensor:
    """Each prompt's matrices [B, len(layers), d_model, d_model] (float32): one forward of `dim_chunk` copies of
    each prompt, then plain backward calls, copy k carrying the one-hot cotangent of output dimension
    start + k. The model's weights must not require gradients (`frozen`): the graph is rooted at
    resid_post.layers[0].

    Causal attention: positions before `skip_first` are neither sources nor targets, and no later position's
    gradient reaches them. Where the model can start part-way (`prefix_support` "positions"), the graph holds
    positions skip_first.. only, blocks layers[0]+1.. attending to the earlier positions through a frozen
    key/value prefix recorded without gradients (once per prompt, not per copy); elsewhere it holds every
    position."""
    x = tokens[:, :-1]  # the last position is neither a source nor a target, and (causal) changes no other
    B = len(x)
    copies = torch.arange(B, device=x.device).repeat(dim_chunk)  # row k * B + b: copy k of prompt b
    if skip_first > 0 and prefix_support(model) == "positions":
        first, final, sources = _suffix_graph(model, x, copies, layers, skip_first)
    else:
        first, final, sources = 0, *_full_graph(model, x[copies], layers)
    T, d = final.shape[1:]
    pos = first + torch.arange(T, device=final.device)
    lengths = lengths.to(final.device)
    valid = (pos[None, :] >= skip_first) & (pos[None, :] < lengths[:, None] - 1)  # [B, T]
    weights = (valid / valid.sum(1, keepdim=True)).to(final.dtype)  # the mean over source positions
    planted = valid.to(final.dtype).repeat(dim_chunk, 1)  # [R, T]: each copy's cotangent at its targets
    copy_of_row = torch.arange(dim_chunk, device=final.device).repeat_interleave(B)  # [R]
    result = torch.zeros(B, len(layers), d, d)
    cot = torch.zeros_like(final)
    starts = list(range(0, d, dim_chunk))
    for n_done, start in enumerate(starts):
        c = min(dim_chunk, d - start)  # the last chunk's extra copies get no cotangent
        cot.zero_()
        rows = torch.arange(c * B, device=final.device)
        cot[rows, :, start + copy_of_row[:c * B]] = planted[:c * B]
        grads = torch.autograd.grad(final, sources, cot, retain_graph=n_done < len(starts) - 1)
        for i, g in enumerate(grads):  # [R, T, d] -> rows start..start+c of every prompt's matrix
            per_copy = g.view(dim_chunk, B, T, d)[:c]
            result[:, i, start:start + c] = torch.einsum("cbtd,bt->bcd", per_copy, weights).float().cpu()
    return result


def _full_graph(model: ModelAdapter, x: Tensor, layers: list[int]) -> tuple[Tensor, list[Tensor]]:
    """A full forward rooted at resid_post.layers[0]: (the last block's output, the sources), all positions. The
    forward ends at the last block (`final_residual`): no unembedding, whose logits at every position of every
    copy (Gemma 3's vocabulary: 1 MiB a position) would sit beside the saved forward for nothing."""
    kept: dict[int, Tensor] = {}

    def keep(L: int, root: bool = False) -> Callable[[Tensor], Tensor]:
        def fn(h: Tensor) -> Tensor:
            kept[L] = h.detach().requires_grad_(True) if root else h
            return kept[L]
        return fn

    ivs = [Intervention(model.resolve(ActName("resid_post", layers[0])), keep(layers[0], root=True))]
    ivs += [Intervention(model.resolve(ActName("resid_post", L)), keep(L)) for L in layers[1:]]
    with torch.enable_grad():
        final = model.backend.final_residual(x.to(model.device), model.lower(ivs))
    return final, [kept[L] for L in layers]


def _suffix_graph(model: ModelAdapter, x: Tensor, copies: Tensor, layers: list[int],
                  position: int) -> tuple[int, Tensor, list[Tensor]]:
    """Blocks layers[0]+1.. on positions `position`.. of the rows `copies` (indices into x) with the earlier
    positions' keys/values frozen (recorded by a run of x without gradients): (position, the last block's
    output, the sources), positions position.. only."""
    n = model.structure.n_layers
    layer = layers[0] + 1  # resid_pre of that block is resid_post of layers[0]
    with torch.no_grad():
        acts = dict(model.run(x, prefix_reads(model, [layer], positions=True), logits=False).acts)
        record_past(model, acts, layer)
    start = slice_start(acts, copies.to(model.device), layer, position, n)
    start.resid = start.resid.detach().requires_grad_(True)
    kept: dict[int, Tensor] = {}

    def keep(L: int) -> Callable[[Tensor], Tensor]:
        def fn(h: Tensor) -> Tensor:
            kept[L] = h
            return h
        return fn

    ivs = model.lower([Intervention(model.resolve(ActName("resid_post", L)), keep(L)) for L in layers[1:]])
    with torch.enable_grad():
        final = model.backend.walk(start, ivs, model.structure)
    return position, final, [start.resid] + [kept[L] for L in layers[1:]]


@contextmanager
def frozen(module: Any) -> Iterator[None]:
    """The weights stop requiring gradients (the graph starts at the residual stream); restored after."""
    saved = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in saved:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def fit_metadata(model: ModelAdapter, op: JacobianLensFit, st: FitState, n: int) -> dict[str, Any]:
    """Provenance in TransformerLens's keys (so its `validate_model` accepts a lens fitted on a plain bridge),
    plus entoscope's: the model mode, the version and the weights' fingerprint (models/fingerprint.py)."""
    from .. import __version__
    from ..models.fingerprint import weights_fingerprint

    module = model.module
    cfg = getattr(module, "cfg", None)
    return {"model_name": getattr(cfg, "model_name", None) or model.name, "model_revision": _revision(model),
            "estimator": ESTIMATOR, "hook_convention": "blocks.{layer}.hook_out", "corpus": st.corpus,
            "n_prompts": n, "fit_dtype": str(next(module.parameters()).dtype).removeprefix("torch."),
            "target_layer": model.structure.n_layers - 1, "max_seq_len": st.max_length,
            "skip_first_positions": op.skip_first, "prepend_bos": op.prepend_bos,
            "entoscope_mode": model.structure.mode, "entoscope_version": __version__,
            "entoscope_weights": weights_fingerprint(model)}


def _corpus_name(data: Dataset) -> str:
    params = ", ".join(f"{k}={v}" for k, v in sorted(data.params.items()))
    return f"{data.name}({params})" if params else data.name


def _takeaway(result: Result) -> str:
    t = result.table
    worst = t.loc[t["split_half_change"].fillna(np.inf).idxmax()]
    far = t.loc[t["identity_distance"].idxmax()]
    settled = "" if not np.isfinite(worst["split_half_change"]) else (
        f"; between the even- and odd-numbered prompts the matrices change by at most "
        f"{worst['split_half_change']:.1%} (layer {int(worst['layer'])})")
    return (f"The Jacobian lens was fitted on {int(t['n_prompts'].iloc[0])} prompts ({int(t['positions'].iloc[0])} "
            f"positions) for layers {int(t['layer'].min())}..{int(t['layer'].max())}; layer {int(far['layer'])} is "
            f"furthest from the logit lens's identity (relative distance {far['identity_distance']:.2f}){settled}.")
