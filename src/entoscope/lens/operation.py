"""The lens operation: decode activations into the vocabulary at every site, over a dataset.

Per site and prompt: the top-k tokens and probabilities; when the data names answers, the first
answer's rank (0 = top), probability and logit; and KL(model's final distribution || lens
distribution) at that position. Over the dataset (`summarise_lens`, from the per-prompt table
only): the mean of each with its bootstrap interval over prompts (`<col>_ci_low`, `<col>_ci_high`,
`<col>_se`, one `ci_level`), the spread, and the top tokens of the mean lens distribution. The maths is in `project.py` (normalisation conventions documented
there and in docs/lens.md). One batched run per batch of prompts; one matmul per chunk of sites.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field
from torch import Tensor

from ..data.examples import Dataset
from ..data.tokenized import Batch, TokenizedData, make_batches, pad_id, tokenize_data
from ..errors import ConfigError, SiteError
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt
from ..metrics import readable
from ..models.adapter import ModelAdapter
from ..models.footprint import FIXED, Footprint
from ..models.names import ActName
from ..models.vocabulary import Vocabulary
from ..operation import Operation, Plan, Prepared, progress, register_operation
from ..results.result import Result
from ..sites import Sites, SiteSet, absolute_positions, position_text
from ..results.lazy import LazyTable
from ..results.figures import interval_note, noted
from ..stats import Stats, error_arrays, interval_columns, share_interval, streamed_mean, summarise
from ..stats.columns import hover_value, interval_bars, level_text
from ..stats.footprint import summary_bytes
from ..stats.moments import column_moments
from .project import (COMPONENTS, RESIDUAL_STATES, ComponentScale, check_lens_kind, decode_components,
                      decode_states, residual_after, to_residual_basis)
from .jacobian import JacobianLens
from .takeaway import lens_takeaway
from .top_tokens import top1_shares
from .tuned import TunedLens


@dataclass(frozen=True)
class LensState:
    """What the lens's prepare resolved."""

    td: TokenizedData
    siteset: SiteSet
    rows: list[dict[str, Any]]  # one per unit: its members, position, table columns, activation (_rows)
    reads: list[ActName]
    batches: list[Batch]
    lens: TunedLens | JacobianLens | None  # method "tuned": the loaded translators; "jacobian": the matrices
    chunk: int  # sites decoded per matmul


@register_operation
class Lens(Sharded, Operation):
    """Logit, tuned or Jacobian lens over sites x prompts.

    method:          "logit" (nostalgebraist 2020), "tuned" (Belrose et al. 2023; needs `translators`) or
                     "jacobian" (Gurnee et al. 2026; needs `lens`, a fitted JacobianLens file or folder).
    sites:           what to decode; default every layer's resid_post at every position. Without a
                     position axis in `over`, the last token of each prompt is decoded.
    top_k:           how many top tokens to report per site.
    component_scale: how a component output (attn_out, mlp_out, result, ...) is normalised:
                     "residual", "final" or "recompute" (see entoscope.lens.project).
    translators:     folder of a trained tuned lens (ours or the tuned-lens package's).
    lens:            a Jacobian lens: the .pt file (ours, TransformerLens 4.3's or the reference package's) or
                     its folder (entoscope train-lens --method jacobian).
    """

    name = "lens"
    method: Literal["logit", "tuned", "jacobian"] = Field(default="logit", description="logit (nostalgebraist 2020), "
        "tuned (Belrose et al. 2023; needs translators) or jacobian (Gurnee et al. 2026; needs lens)")
    sites: Sites = Field(default_factory=lambda: Sites(activation="resid_post", over=["layer", "position"]),
                         description="what to decode; default every layer's resid_post at every position (without a "
                         "position axis: each prompt's last token)")
    top_k: int = Field(default=5, ge=1, le=100, description="top tokens reported per site")
    component_scale: ComponentScale = Field(default="residual", description="the final norm's frozen scale for a "
                                            "component (attn_out, mlp_out, result, ...): residual (its layer's "
                                            "stream), final (the last stream: DLA's), or recompute (its own)")
    translators: str | None = Field(default=None, description="folder of a trained tuned lens (entoscope train-lens, "
                                    "or the tuned-lens package's)")
    lens: str | None = Field(default=None, description="a Jacobian lens: its .pt file (ours, TransformerLens 4.3's "
                             "or the reference package's) or its folder")
    answer_scoring: Literal["first_token", "single"] = Field(default="first_token", description="an answer of "
        "several tokens: first_token reads its first token (one shared by a correct and a wrong answer is read for "
        "neither); single refuses it (multi_token_answer)")

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[LensState]:
        assert data is not None
        kind, _ = self.sites.kind()
        check_lens_kind(kind.name, model.structure.post_norms)
        td = tokenize_data(model, data, prepend_bos=self.prepend_bos, answers=data.has_answers,
                           answer_scoring=self.answer_scoring)
        siteset = self.sites.resolve(model, td.lengths, td.roles)
        if kind.name in RESIDUAL_STATES and any(u.is_group for u in siteset.units):
            raise ConfigError("a group of residual-stream states has no meaning for the lens",
                              code="lens_group_of_states", remedy="group components (heads, MLPs), not states")
        lens = None
        if self.method == "tuned":
            if self.translators is None:
                raise ConfigError("method 'tuned' needs translators", code="tuned_lens_missing",
                                  remedy="train them (entoscope train-lens ... --out DIR) and pass translators: DIR")
            if kind.name not in ("resid_pre", "resid_post"):
                raise ConfigError(f"the tuned lens decodes resid_pre/resid_post, not {kind.name}",
                                  code="tuned_lens_site", remedy="use method 'logit' for components")
            lens = TunedLens.load(self.translators).to(model.device)  # loaded on the CPU; read on the model's device
            lens.check_model(model)
        rows = _rows(siteset)
        if self.method == "jacobian":
            lens = _jacobian_lens(self.lens, model, kind.name, rows)
        reads = _reads(model, siteset, kind.name, self.component_scale)
        s = model.structure
        T = max(td.lengths)
        chunk = _unit_chunk(len(rows), s.d_vocab)
        peak = lens_footprint(model, reads, len(rows), len(td), T, chunk, self.top_k, self.stats)
        bs = self.choose_batch_size(0, len(td), peak_of=peak)
        batches = make_batches(td, bs, pad_id(model))
        notes = [siteset.note] if siteset.note else []
        if "pos" not in siteset.over:
            notes.append("no position axis: the last token of each prompt is decoded")
        if kind.name in COMPONENTS:
            notes.append(f"components normalised with component_scale={self.component_scale!r}")
        plan = Plan(self.name, rows=len(rows), forward_passes=len(td), backward_passes=0,
                    batch_sizes=[len(b) for b in batches], examples=len(td),
                    peak_memory_bytes=peak(bs), notes=notes)
        return Prepared(model, data, plan, LensState(td, siteset, rows, reads, batches, lens, chunk))

    # sharded (docs/scale.md): a shard returns its prompts' rows and its sum of the decoded distributions
    def execute_shard(self, prepared: Prepared[LensState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        model, st = prepared.model, prepared.state
        rows = st.rows
        mine = [st.batches[i] for i in batches]
        prob_sum = torch.zeros(len(rows), model.structure.d_vocab, dtype=torch.float64)
        parts: list[dict[str, Tensor]] = []
        with torch.no_grad():
            for batch in progress(mine, total=len(mine), desc="lens", quiet=quiet):
                parts.append(self._decode_batch(model, batch, st, rows, st.siteset.kind.name, prob_sum))
        arrays = {k: torch.cat([p[k] for p in parts]).numpy() for k in parts[0]}
        return PerPrompt([i for b in mine for i in b.index], arrays, sums={"prob_sum": prob_sum.numpy()})

    def summarise(self, prepared: Prepared[LensState], merged: dict[str, Any], *, quiet: bool = False) -> Result:
        model, st = prepared.model, prepared.state
        kind = st.siteset.kind.name
        columns = merged["main"]
        n = columns.n
        mean_probs = torch.from_numpy(columns["prob_sum"]) / n
        sites = [r["cols"] for r in st.rows]
        keys = [k for k in dict.fromkeys(ARRAY_OF.values()) if k in columns.keys()]
        table = lens_summary(n, len(sites), lambda lo, hi: _aggregates(columns.read(lo, hi, keys)), sites,
                             self.stats, self.seed)
        table = _with_top_tokens(table, mean_probs, model, self.top_k)
        table = top1_shares(table, n, lambda lo, hi: columns.read(lo, hi, ["top_ids"])["top_ids"][:, :, 0],
                            mean_probs.argmax(-1).numpy(), lambda i: model.tokenizer.decode([int(i)]),
                            self.stats.ci_level)
        vocab = model.vocab_strings()
        frame = pd.DataFrame.from_records(sites)
        per_prompt = LazyTable(n, lambda lo, hi: lens_rows(frame, columns.read(lo, hi), vocab, lo, self.top_k),
                               rows_per_prompt=len(sites))
        return Result(self.name, table, per_prompt=per_prompt, figures=_figures,
                      title=f"{self.method} lens on {kind}: what the residual stream predicts at each layer",
                      extra={"mean_probs": mean_probs,
                             "prompt_lengths": (min(st.td.lengths), max(st.td.lengths))},
                      takeaway=lens_takeaway)

    def _decode_batch(self, model: ModelAdapter, batch: Any, st: LensState, rows: list[dict[str, Any]],
                      kind: str, prob_sum: Tensor) -> dict[str, Tensor]:
        """One batch's per-prompt arrays [B, U(, k)]: position and token decoded, KL, top-k, the answer's numbers."""
        k = self.top_k
        out = model.run(batch.tokens, st.reads)
        vectors, scales, positions = _gather(model, out.acts, rows, kind, batch.lengths, self.component_scale,
                                            batch.roles)
        final_logp = readable(out.logits).log_softmax(-1)
        final_p = final_logp.exp()
        b_idx = torch.arange(len(batch))
        parts: dict[str, list[Tensor]] = {}
        for start in range(0, len(rows), st.chunk):
            sl = slice(start, start + st.chunk)
            vec = vectors[sl]  # [U, B, d_model]
            if kind in RESIDUAL_STATES:
                if st.lens is not None:
                    vec = torch.stack([st.lens.transform(v, st.lens.index_of(r["act"]))
                                       for v, r in zip(vec, rows[sl])])
                logits = decode_states(model, vec)
            else:
                logits = decode_components(model, vec, None if scales is None else scales[sl])
            logits = readable(logits)
            logp = logits.log_softmax(-1)  # [U, B, V]
            p = logp.exp()
            pos = positions[sl]  # [U, B]
            # KL(final || lens) = sum_v p_final (log p_final - log p_lens)
            kl = (final_p[b_idx[None, :], pos] * (final_logp[b_idx[None, :], pos] - logp)).sum(-1)
            prob_sum[sl] += p.sum(1, dtype=prob_sum.dtype)
            top_lp, top_i = logp.topk(k, dim=-1)
            chunk = {"position": pos, "token": batch.tokens[b_idx[None, :], pos.to(batch.tokens.device)], "kl": kl,
                     "top_ids": top_i, "top_probs": top_lp.exp()}
            if batch.answers is not None:
                target = batch.answers[:, 0]
                t_logit = logits.gather(-1, target[None, :, None].expand(logits.shape[0], -1, 1))[..., 0]
                chunk["target_prob"] = p.gather(-1, target[None, :, None].expand(p.shape[0], -1, 1))[..., 0]
                chunk["target_rank"] = (logits > t_logit[..., None]).sum(-1)
                chunk["target_logit"] = t_logit
            for key, value in chunk.items():
                parts.setdefault(key, []).append(value.detach().cpu())
        arrays = {key: torch.cat(v).transpose(0, 1).contiguous() for key, v in parts.items()}  # [B, U(, k)]
        if batch.answers is not None:
            arrays["target"] = batch.answers[:, 0].cpu()
        return arrays


# ---------------------------------------------------------------------- helpers
def lens_footprint(model: ModelAdapter, reads: list[ActName], U: int, n: int, T: int, chunk: int, k: int,
                   stats: Stats) -> Callable[[int], int]:
    """peak(B): the bytes a lens run with batches of B prompts takes above the loaded model (memory.py). While it
    decodes: the sum of the decoded distributions [U, V] (float64), every prompt's values, and per prompt of the
    batch its forward with the logits at every position, the final distribution's log-probabilities and
    probabilities, the activations read and its share of a chunk of decoded sites ([chunk, B, V], a few float32
    copies); when the table is made: that sum twice (the mean) and the statistics' chunks."""
    fp = Footprint(model)
    V = model.structure.d_vocab
    per_example = (fp.forward(1, T) + fp.act(reads, 1, T) + fp.vocab(T, 2 + (fp.f != 4))
                   + fp.vocab(chunk, 8))
    sums, values = U * V * 8, n * U * (2 * k + 6) * 8
    table = 2 * sums + summary_bytes(n, 5 * U, stats)
    return lambda B: FIXED + max(sums + values + B * per_example, table)


def _unit_chunk(n_rows: int, d_vocab: int, budget_floats: int = 2**24) -> int:
    """Sites decoded per matmul: bounded so [sites, batch, vocab] stays ~ budget_floats x 4 bytes / batch."""
    return max(1, min(n_rows, budget_floats // (64 * d_vocab)))


def _rows(siteset: SiteSet) -> list[dict[str, Any]]:
    """One row per (unit): its members and its table columns. Without a pos axis: the position that
    `positions` selects, else each prompt's last token (position -1, labelled END)."""
    rows = []
    frame = siteset.frame().to_dict("records")  # roles and positions from the end as labels ("S2", "END-2")
    for i, u in enumerate(siteset.units):
        pos = u.get("pos")
        if pos is None and any("pos" in dict(m) for m in u.members):
            raise SiteError(f"site {u.label!r} reads several positions together: a lens decodes one position "
                            "per row", code="bad_selection", remedy="add position to sites.over")
        cols: dict[str, Any] = dict(frame[i])
        if "pos" not in siteset.over:
            cols["position"] = position_text(-1 if pos is None else pos, siteset.role_names)
        layer = u.get("layer")
        act = ActName(siteset.kind.name, layer) if siteset.kind.per_layer and layer is not None else None
        rows.append({"unit": u, "pos": -1 if pos is None else pos, "cols": cols, "act": act})
    return rows


def _reads(model: ModelAdapter, siteset: SiteSet, kind: str, scale_mode: str) -> list[ActName]:
    reads: set[ActName] = set()
    for u in siteset.units:
        for m in u.members:
            layer = dict(m).get("layer")
            reads.add(ActName(kind, layer) if siteset.kind.per_layer else ActName(kind))
            if kind in COMPONENTS:
                if scale_mode == "residual":
                    reads.add(residual_after(model, kind, layer))
    if kind in COMPONENTS and scale_mode == "final":
        reads.add(ActName("final_scale"))
    return sorted(reads)


def _gather(model: ModelAdapter, acts: dict[ActName, Tensor], rows: list[dict[str, Any]], kind: str,
            lengths: Tensor, scale_mode: str, roles: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """Per row: the decoded vector [U, B, d_model], its frozen scale [U, B, 1] (components) and positions [U, B]."""
    B = lengths.shape[0]
    b = torch.arange(B)
    vectors, scales, positions = [], [], []
    for r in rows:
        pos = absolute_positions(r["pos"], lengths, roles)
        positions.append(pos)
        total = None
        for m in r["unit"].members:
            d = dict(m)
            layer = d.get("layer")
            act = acts[ActName(kind, layer) if layer is not None else ActName(kind)]
            x = act[b, pos]  # [B, ...axes without pos]
            x = to_residual_basis(model, kind, layer, x)
            if kind in ("result", "z", "v"):
                x = x[:, d["head"]] if "head" in d else x.sum(1)
            elif kind == "mlp_post":
                x = x[:, d["neuron"]] if "neuron" in d else x.sum(1)
            total = x if total is None else total + x
        vectors.append(total)
        if kind in COMPONENTS and scale_mode != "recompute":
            layer = r["unit"].get("layer")
            if scale_mode == "final":
                scales.append(acts[ActName("final_scale")][b, pos])
            else:
                resid = acts[residual_after(model, kind, layer)][b, pos]
                scales.append(model.weights.final_norm.scale(resid))
    scale_t = torch.stack(scales) if scales else None
    return torch.stack(vectors), scale_t, torch.stack(positions)


# per-prompt column -> (table column, how a prompt's value enters the mean)
LENS_AGGREGATES = {"kl_mean": "kl_to_final", "target_prob_mean": "target_prob", "target_logit_mean": "target_logit",
                   "target_rank_mean": "target_rank", "target_top1": "target_rank"}
ARRAY_OF = {"kl_to_final": "kl", "target_prob": "target_prob", "target_logit": "target_logit",
            "target_rank": "target_rank"}  # per-prompt table column -> per-prompt array


def summarise_lens(per_prompt: pd.DataFrame, sites: list[dict[str, Any]], stats: Stats, seed: int) -> pd.DataFrame:
    """One row per site from the per-prompt table alone (what `lens_summary` computes from the arrays)."""
    names = [s["site"] for s in sites]
    grids = {col: per_prompt.pivot(index="example", columns="site", values=col).reindex(columns=names)
             .to_numpy(dtype=float) for col in set(LENS_AGGREGATES.values()) if col in per_prompt}
    n = len(next(iter(grids.values()))) if grids else 0
    arrays = {ARRAY_OF[col]: v for col, v in grids.items()}
    return lens_summary(n, len(names), lambda lo, hi: _aggregates({k: v[lo:hi] for k, v in arrays.items()}),
                        sites, stats, seed)


def _aggregates(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The values each aggregate averages over prompts ([rows, sites] float64), from the per-prompt arrays."""
    out = {}
    for agg, col in LENS_AGGREGATES.items():
        if ARRAY_OF[col] not in arrays:
            continue
        values = np.asarray(arrays[ARRAY_OF[col]], dtype=np.float64)
        out[agg] = (values == 0).astype(float) * np.where(np.isfinite(values), 1.0, np.nan) \
            if agg == "target_top1" else values
    return out


def lens_summary(n: int, n_sites: int, read: Any, sites: list[dict[str, Any]], stats: Stats, seed: int) -> pd.DataFrame:
    """One row per site from the per-prompt values read in blocks (read(lo, hi) -> {aggregate: [rows, sites]}).

    Per site: `kl_mean` (and with answers `target_prob_mean`, `target_logit_mean`, `target_rank_mean`,
    `target_top1` = share of prompts whose answer is the lens's top token), each the mean over prompts
    with its bootstrap interval over prompts (one resampling of the prompts for every column and
    site), but for `target_top1`, a share, whose interval is Wilson's (stats/proportion.py; its `_se` stays
    the bootstrap's); `kl_std`, `target_prob_std`, `target_logit_std` the spread over prompts (ddof 0)."""
    table = pd.DataFrame.from_records(sites)
    wanted = list(read(0, min(n, 1))) if n else []
    if not wanted:
        return table
    U = n_sites

    def stacked(lo: int, hi: int) -> np.ndarray:
        block = read(lo, hi)
        return np.concatenate([block[agg] for agg in wanted], axis=1)  # [rows, aggregates x sites]
    width = len(wanted) * U
    summary = summarise(streamed_mean(n, width, stacked), stats, seed)
    moments = column_moments(n, width, stacked)
    table["n_prompts"] = moments.count[:U].astype(int)
    for j, agg in enumerate(wanted):
        part = slice(j * U, (j + 1) * U)
        table[agg] = summary.value[part]
        for key, value in interval_columns(summary, agg, stats).items():
            table[key] = value[part]
        if agg in ("kl_mean", "target_prob_mean", "target_logit_mean"):
            table[agg.replace("_mean", "_std")] = moments.std[part]
        if agg == "target_top1":  # a share of prompts: the Wilson interval (the bootstrap's is degenerate at 0 and n)
            table["target_top1_ci_low"], table["target_top1_ci_high"] = share_interval(
                summary.value[part], moments.count[part], stats.ci_level)
    table["ci_level"] = stats.ci_level
    return table


def lens_rows(sites: pd.DataFrame, arrays: dict[str, np.ndarray], vocab: Vocabulary, lo: int, k: int) -> pd.DataFrame:
    """The per-prompt table of prompts lo.. (one row per prompt and site, prompt-major) from their arrays."""
    E, U = arrays["kl"].shape
    frame = sites.iloc[np.tile(np.arange(U), E)].reset_index(drop=True)
    frame.insert(0, "example", np.repeat(np.arange(lo, lo + E), U))
    frame["token_position"] = arrays["position"].reshape(-1).astype(np.int64)
    frame["token"] = vocab.take(arrays["token"].reshape(-1))
    frame["kl_to_final"] = arrays["kl"].reshape(-1).astype(np.float64)
    for t in range(k):
        frame[f"top{t + 1}_token"] = vocab.take(arrays["top_ids"][:, :, t].reshape(-1))
        frame[f"top{t + 1}_prob"] = arrays["top_probs"][:, :, t].reshape(-1).astype(np.float64)
    if "target" in arrays:
        frame["target"] = vocab.take(np.repeat(arrays["target"], U))
        frame["target_rank"] = arrays["target_rank"].reshape(-1).astype(np.int64)
        frame["target_prob"] = arrays["target_prob"].reshape(-1).astype(np.float64)
        frame["target_logit"] = arrays["target_logit"].reshape(-1).astype(np.float64)
    return frame


def _with_top_tokens(table: pd.DataFrame, mean_probs: Tensor, model: ModelAdapter, k: int) -> pd.DataFrame:
    """The top-k tokens of each site's mean lens distribution (descriptive: no interval)."""
    top_p, top_i = mean_probs.topk(k, dim=-1)
    for t in range(k):
        table[f"top{t + 1}_token"] = [model.tokenizer.decode([int(i)]) for i in top_i[:, t]]
        table[f"top{t + 1}_prob"] = top_p[:, t].tolist()
    return table


MAX_LINES = 6  # positions drawn as lines in the by-layer charts (the last ones)
SCALE_TITLES = {"target_prob_mean": "probability<br>of the answer", "top1_prob": "probability<br>of the top-1 token"}


def _hover(t: pd.DataFrame, value: str) -> list[str]:
    """Per site: its name, the value with its interval, the KL with its interval, and n."""
    out = []
    for r in t.to_dict("records"):
        text = f"{r['site']}<br>{hover_value(r, value)}"
        if value != "kl_mean":
            text += f"<br>{hover_value(r, 'kl_mean')}"
        text += f"<br>top-1 of the mean distribution {r['top1_token']!r}"
        if "top1_token_share" in r:
            text += (f" (the top-1 of {r['top1_token_share']:.0%} of prompts)<br>most common top-1 over prompts "
                     f"{r['modal_token']!r}<br>{hover_value(r, 'modal_share')}")
        out.append(text + f"<br>n = {int(r['n_prompts'])}")
    return out


def _by_layer(t: pd.DataFrame, value: str, ylabel: str) -> tuple[str, Any]:
    import plotly.graph_objects as go

    fig = go.Figure()
    positions = list(dict.fromkeys(t["position"])) if "position" in t else [None]
    shown = positions[-MAX_LINES:]
    for p in shown:
        sub = t if p is None else t[t["position"] == p]
        sub = sub.sort_values("layer")
        fig.add_trace(go.Scatter(x=sub["layer"], y=sub[value], mode="lines+markers", name=f"position {p}",
                                 text=_hover(sub, value), hovertemplate="%{text}<extra></extra>",
                                 **interval_bars(sub, value, "site")))
    bars = interval_note(level_text(t)) if error_arrays(t, value) is not None else "no interval (stats.n_boot = 0)"
    fig.update_layout(xaxis_title="layer", yaxis_title=noted(ylabel, bars), height=360, legend={"orientation": "h"})
    fig.update_xaxes(dtick=1)
    which = "" if len(shown) == len(positions) else f" (the last {len(shown)} of {len(positions)} positions)"
    return f"{ylabel} by layer{which}", fig


def _figures(result: Result) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    t = result.table
    figs = []
    value = "target_prob_mean" if "target_prob_mean" in t else "top1_prob"
    if "layer" in t and "position" in t and t["position"].nunique() > 1:
        grid = t.pivot_table(index="layer", columns="position", values=value, aggfunc="first", sort=False)
        shown = "modal_token" if "modal_token" in t else "top1_token"  # the prompts' own top-1 tokens
        text = t.pivot_table(index="layer", columns="position", values=shown, aggfunc="first", sort=False)
        hover = t.assign(_hover=_hover(t, value)).pivot_table(index="layer", columns="position", values="_hover",
                                                             aggfunc="first", sort=False)
        text, hover = (f.reindex(index=grid.index, columns=grid.columns) for f in (text, hover))
        text = text.map(lambda tok: repr(tok) if isinstance(tok, str) and not tok.strip() else tok)  # ' ', '\n': seen
        labels = [str(c) for c in grid.columns]
        first = result.per_prompt_head(1)
        if first is not None and len(first):
            tok = first.drop_duplicates("position").set_index("position")["token"].to_dict()
            labels = [f"{c}: {tok.get(c, '')!r}" for c in grid.columns]
        fig = go.Figure(go.Heatmap(z=grid.values, x=labels, y=list(grid.index), text=text.values,
                                   customdata=hover.values, hovertemplate="%{customdata}<extra></extra>",
                                   texttemplate="%{text}", colorscale="Blues",
                                   colorbar={"title": SCALE_TITLES.get(value, value)}))
        fig.update_layout(xaxis_title="position (token of the first prompt)", yaxis_title="layer", height=420)
        what = "the most common top-1 token over prompts" if shown == "modal_token" \
            else "top-1 token of the mean distribution"
        title = f"{value} by layer and position (text: {what}; hover: the {level_text(t)} interval over prompts)"
        figs.append((title, fig))
    if "layer" in t and t["layer"].notna().all():
        figs.append(_by_layer(t, "kl_mean", "KL(final || lens), nats"))
        if "target_prob_mean" in t:
            figs.append(_by_layer(t, "target_prob_mean", "probability of the answer"))
    return figs


def _jacobian_lens(path: str | None, model: ModelAdapter, kind: str, rows: list[dict[str, Any]]) -> JacobianLens:
    """The Jacobian lens at `path`, checked against the model and every site (before any work)."""
    if path is None:
        raise ConfigError("method 'jacobian' needs lens", code="jacobian_lens_missing",
                          remedy="fit one (entoscope train-lens --method jacobian ... --out DIR) and pass lens: DIR")
    if kind not in ("resid_pre", "resid_post"):
        raise ConfigError(f"the Jacobian lens transports block outputs (resid_post), not {kind}",
                          code="jacobian_lens_site", remedy="use resid_post sites, or method 'logit' for components")
    lens = JacobianLens.load(path)
    lens.check_model(model)
    for r in rows:
        lens.index_of(r["act"])
    return lens
