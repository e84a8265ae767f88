"""Coordinate patching (Gurnee et al. 2026): edit named coordinates of an activation's Jacobian-lens
decomposition and run the model on from there, over a dataset, beside a random-coordinate control.

For each prompt and site (block l's output, resid_post.l, at a position; default each prompt's last token):

1. the activation x is decomposed into lens vectors (jspace.decompose: at most `k` nonnegative coefficients
   c_t on the rows a_t of W_U^T J[l]; the last block's output reads the unembedding directions W_U[:, t]);
2. the edit moves the coordinates of the prompt's answer token A (its first correct answer's first token) and
   wrong token W (its first wrong answer's), as TransformerLens 4.3's `coordinate_patch` does (A is the source,
   W the target), by `alpha` times:
       swap:        c_A <-> c_W                      (dc_A = c_W - c_A, dc_W = c_A - c_W)
       substitute:  c_W <- c_A, c_A <- 0             (dc_A = -c_A,      dc_W = c_A - c_W)
       remove:      c_A <- 0                         (dc_A = -c_A)
   a token outside the support has coefficient 0 there. The edited activation is x + sum_t dc_t a_t: every
   other coordinate and the reconstruction's residual x - sum_t c_t a_t are kept, so alpha 0 (or an edit whose
   changes are 0) leaves x as it is, bit for bit;
3. the control moves as many coordinates, drawn at random from the same decomposition's support without A and
   W (from the rest of the vocabulary where the support has too few: `control_from_vocab`), each by the same
   length along its own lens vector as the edited one moved along its: x + sum_i dc_i |a_{t_i}| a_{r_i} / |a_{r_i}|
   (per prompt, site and seed: the draw does not depend on batching);
4. the model runs on from the edited (and the control's) activation, and the metric (logit_diff by default)
   is read at the answer position.

Per site the table has the unedited metric, `effect` = edited - unedited, `control_effect` = control -
unedited and `minus_control` = edited - control (paired per prompt), each a mean with its bootstrap interval
over prompts; the share of prompts whose answer token is in the support (Wilson interval); the reconstruction
error; and `beats_control`: the effect's interval excludes 0 and minus_control's does too, on the effect's
side (docs/pages.md, the rule "beats its random baseline").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from ..data.examples import Dataset
from ..data.tokenized import Batch, TokenizedData, make_batches, pad_id, tokenize_data
from ..errors import ConfigError, DataError
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt
from ..metrics import Metric, check_metric_runs, metric_where, readable
from ..models.adapter import Intervention, ModelAdapter
from ..models.names import ActName
from ..operation import Operation, Plan, Prepared, progress, register_operation
from ..results.result import Result
from ..sites import Sites, SiteSet, absolute_positions
from .coordinate_summary import coordinate_result
from .jacobian import JacobianLens
from .jacobian_source import JacobianSource, LensSource, prepare_source
from .jspace import Atoms, decompose_many
from .operation import _rows

Edit = Literal["swap", "substitute", "remove"]
TOP = 3  # support tokens kept per prompt in the per-prompt table


@dataclass(frozen=True)
class CoordinateState:
    td: TokenizedData
    siteset: SiteSet
    rows: list[dict[str, Any]]  # one per site: its unit, position code, table columns, activation
    batches: list[Batch]
    source: LensSource


@register_operation
class CoordinatePatching(JacobianSource, Sharded, Operation):
    """Coordinate patching (Gurnee et al. 2026): edit the answer's Jacobian-lens coordinates and run on.

    sites:   block outputs (resid_post) edited, one row per site; default every layer at each prompt's last
             token (a position selection or a position axis picks others).
    edit:    swap (the answer's and the wrong answer's coefficients exchanged), substitute (the answer's moved
             to the wrong answer, the answer's set to 0) or remove (the answer's set to 0).
    alpha:   the coefficients move by alpha times the edit's change (0: no edit).
    k:       at most k lens vectors per decomposition.
    metric:  read at the answer position of the edited, control and unedited runs (kl: to the unedited run).
    lens / fit_data: the Jacobian lens (a file, or fitted in the run on a few texts: said on the page).
    """

    name = "coordinate_patching"
    sites: Sites = Field(default_factory=lambda: Sites(activation="resid_post", over=["layer"], positions=[-1]),
                         description="block outputs edited (resid_post), one row per site; default every layer at "
                         "each prompt's last token")
    edit: Edit = Field(default="swap", description="swap: the answer's and the wrong answer's coefficients exchanged; "
                       "substitute: the answer's moved to the wrong answer, the answer's set to 0; remove: the "
                       "answer's set to 0")
    alpha: float = Field(default=1.0, allow_inf_nan=False, description="coefficients move by alpha times the edit's "
                         "change (0: no edit)")
    k: int = Field(default=25, ge=1, description="at most k lens vectors per decomposition")
    metric: Metric = Field(default_factory=Metric, description="read at the answer position of the edited, control "
                           "and unedited runs (kl: to the unedited run)")
    answer_scoring: Literal["first_token", "single"] = Field(default="first_token", description="an answer of "
        "several tokens: first_token reads its first token (one shared by a correct and a wrong answer is read for "
        "neither); single refuses it (multi_token_answer)")

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[CoordinateState]:
        assert data is not None
        kind, _ = self.sites.kind()
        if kind.name != "resid_post":
            raise ConfigError(f"coordinate patching edits block outputs (resid_post), not {kind.name}",
                              code="jacobian_lens_site", remedy="sites: {activation: resid_post, over: [layer]}")
        if not data.has_answers:
            raise DataError(f"coordinate patching edits the answer's coordinate, and {data.name!r} names no answers",
                            code="data_no_answers", remedy="use a task with answers (ioi, facts, induction)")
        td = tokenize_data(model, data, prepend_bos=self.prepend_bos, answers=True, answer_scoring=self.answer_scoring)
        if self.edit != "remove" and not all(td.wrong_answers or []):
            raise DataError(f"edit {self.edit!r} moves a coordinate to the wrong answer's token, and some prompts of "
                            f"{data.name!r} have no wrong answer", code="data_no_wrong_answers",
                            remedy="use a task with wrong answers (ioi, facts), or edit: remove")
        check_metric_runs(self.metric.function(), model, td)
        siteset = self.sites.resolve(model, td.lengths, td.roles)
        rows = _rows(siteset)
        if any(r["unit"].is_group for r in rows):
            raise ConfigError("a group of residual-stream states has no decomposition", code="lens_group_of_states",
                              remedy="one layer and position per site")
        s = model.structure
        last = s.n_layers - 1
        needed = sorted({r["act"].layer for r in rows if r["act"].layer != last})
        source = prepare_source(self, model, required=True, layers=needed or None)
        if source.lens is not None:
            for r in rows:
                source.lens.index_of(r["act"])
        T = max(td.lengths)
        per_example = 4 * T * (len(rows) + 12) * s.d_model + 4 * T * s.d_vocab
        bs = self.choose_batch_size(per_example, len(td))
        batches = make_batches(td, bs, pad_id(model))
        E, U = len(td), len(rows)
        notes = [siteset.note] if siteset.note else []
        notes += [source.note, f"per prompt: one unedited run, then per site one edited and one control run "
                  f"(full forwards); each site's dictionary is the {s.d_vocab:,} lens vectors of its layer"]
        atoms = 8 * s.d_vocab * s.d_model * 2  # one layer's lens vectors in float64 and their product
        plan = Plan(self.name, rows=U, forward_passes=E * (1 + 2 * U) + source.forward_passes,
                    backward_passes=source.backward_passes, batch_sizes=[len(b) for b in batches], examples=E,
                    peak_memory_bytes=bs * per_example + atoms, notes=notes)
        return Prepared(model, data, plan, CoordinateState(td, siteset, rows, batches, source))

    # ------------------------------------------------------------------ sharded (docs/scale.md)
    def global_step(self, prepared: Prepared[CoordinateState]) -> str:
        return "the Jacobian lens's fit (no lens given)" if prepared.state.source.fit is not None else ""

    def before_phase(self, prepared: Prepared[CoordinateState], phase: str, merged: Any) -> Any:
        """A lens fitted in the run is fitted once, on the driver, and read by every shard."""
        if prepared.state.source.fit is None:
            return None
        lens = prepared.state.source.resolve(quiet=True)
        for r in prepared.state.rows:
            lens.index_of(r["act"])
        return lens

    def execute_shard(self, prepared: Prepared[CoordinateState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        model, st = prepared.model, prepared.state
        lens: JacobianLens | None = prepared.contexts.get(phase) or st.source.lens
        assert lens is not None
        metric = self.metric.function()
        mine = [st.batches[i] for i in batches]
        U, n = len(st.rows), sum(len(b) for b in mine)
        reads = sorted({r["act"] for r in st.rows})
        base, refs, acts, positions = [], [], {u: [] for u in range(U)}, {u: [] for u in range(U)}
        with torch.no_grad():
            for b in mine:  # the unedited runs: the metric, the logits (kl's reference), each site's activation
                out = model.run(b.tokens, reads, logits_at=b.last)
                logits = readable(out.logits)
                refs.append(logits)
                wrong_b = b.wrong_answers if b.wrong_answers is not None else torch.full((len(b), 1), -1)
                base.append(metric(logits, b.answers, wrong_b, logits).double().cpu())
                for u, r in enumerate(st.rows):
                    pos = absolute_positions(r["pos"], b.lengths, b.roles)
                    positions[u].append(pos)
                    acts[u].append(out.acts[r["act"]][torch.arange(len(b)), pos.to(out.acts[r["act"]].device)])
        keys = ("edited", "control", "coef_answer", "coef_wrong", "support_size", "selected_size", "error",
                "answer_in_support", "from_vocab")
        arrays = {key: np.zeros((n, U)) for key in keys}
        arrays["control_tokens"] = np.full((n, U, 2), -1, dtype=np.int64)
        arrays["top_tokens"] = np.full((n, U, TOP), -1, dtype=np.int64)
        arrays["position"] = np.zeros((n, U), dtype=np.int64)
        answers = np.concatenate([b.answers[:, 0].cpu().numpy() for b in mine])
        wrong = np.concatenate([(b.wrong_answers[:, 0] if b.wrong_answers is not None
                                 else torch.full((len(b),), -1)).cpu().numpy() for b in mine])
        examples = [i for b in mine for i in b.index]
        bar = iter(progress(range(U * len(mine)), total=U * len(mine), desc="coordinate patching", quiet=quiet))
        wrong_t = [b.wrong_answers if b.wrong_answers is not None else torch.full((len(b), 1), -1) for b in mine]
        for u, r in enumerate(st.rows):
            atoms = Atoms.of(site_dictionary(lens, model, r["act"]))
            X = torch.cat(acts[u])
            decs = decompose_many(X, atoms, self.k)
            deltas = {"edited": torch.zeros(n, X.shape[1], dtype=torch.float64),
                      "control": torch.zeros(n, X.shape[1], dtype=torch.float64)}
            for i, d in enumerate(decs):
                coef = dict(zip(d.support, d.coefficients))
                a, w = int(answers[i]), int(wrong[i])
                tokens, change = coordinate_change(coef, a, w, self.edit, self.alpha)
                rng = np.random.default_rng([self.seed, int(r["act"].layer), u, int(examples[i])])
                drawn, from_vocab = control_tokens(rng, d.support, {a, w}, len(tokens), atoms.rows.shape[0])
                deltas["edited"][i] = edit_delta(atoms, tokens, change)
                deltas["control"][i] = control_delta(atoms, tokens, change, drawn)
                top = d.support[:TOP]
                arrays["coef_answer"][i, u], arrays["coef_wrong"][i, u] = coef.get(a, 0.0), coef.get(w, 0.0)
                arrays["support_size"][i, u], arrays["selected_size"][i, u] = len(d.support), len(d.selected)
                arrays["error"][i, u], arrays["answer_in_support"][i, u] = d.error, float(a in coef)
                arrays["from_vocab"][i, u] = from_vocab
                arrays["control_tokens"][i, u, :len(drawn)] = drawn
                arrays["top_tokens"][i, u, :len(top)] = top
            del atoms
            start = 0
            for j, b in enumerate(mine):
                rows = slice(start, start + len(b))
                pos = positions[u][j]
                arrays["position"][rows, u] = pos.numpy()
                for which in ("edited", "control"):
                    with metric_where(f"site {r['unit'].label}, {which} run"):
                        logits = run_edited(model, b, r["act"], pos, deltas[which][rows])
                        arrays[which][rows, u] = metric(logits, b.answers, wrong_t[j], refs[j]).double().cpu()
                next(bar, None)
                start += len(b)
        arrays["base"] = torch.cat(base).numpy()
        arrays["answer"], arrays["wrong"] = answers, wrong
        return PerPrompt(examples, arrays)

    def summarise(self, prepared: Prepared[CoordinateState], merged: dict[str, Any], *, quiet: bool = False) -> Result:
        st = prepared.state
        cols = merged["main"]
        result = coordinate_result(self, prepared.model, st.siteset, [r["cols"] for r in st.rows], cols.read(0, cols.n),
                                   fitted=st.source.fit is not None)
        result.notes.append(("the Jacobian lens", st.source.note))
        return result


# ---------------------------------------------------------------------- the edit and its control
def site_dictionary(lens: JacobianLens, model: ModelAdapter, act: ActName) -> Tensor:
    """The lens vectors a site's activation is decomposed into, [d_vocab, d_model]: rows of W_U^T J[l]; the
    last block's output (the lens's target, no matrix) reads the unembedding's own directions W_U[:, t]."""
    index = lens.index_of(act)
    if index is None:
        return model.weights.W_U.detach().float().cpu().T
    return lens.lens_vectors(model, index)


def coordinate_change(coef: dict[int, float], answer: int, wrong: int, edit: str, alpha: float
                      ) -> tuple[list[int], np.ndarray]:
    """The tokens an edit moves and how much each coefficient changes (alpha times the edit's change)."""
    ca, cw = coef.get(answer, 0.0), coef.get(wrong, 0.0)
    if edit == "remove":
        return [answer], alpha * np.array([-ca])
    if edit == "swap":
        return [answer, wrong], alpha * np.array([cw - ca, ca - cw])
    if edit == "substitute":
        return [answer, wrong], alpha * np.array([-ca, ca - cw])
    raise ConfigError(f"unknown edit {edit!r}", code="bad_selection", remedy="swap, substitute or remove")


def control_tokens(rng: np.random.Generator, support: list[int], exclude: set[int], n: int, vocab: int
                   ) -> tuple[list[int], int]:
    """n tokens drawn without replacement from the support minus `exclude`, topped up from the rest of the
    vocabulary where the support has fewer; and how many came from the vocabulary."""
    pool = [t for t in support if t not in exclude]
    if len(pool) >= n:
        return [int(t) for t in rng.choice(pool, size=n, replace=False)], 0
    taken = set(pool) | exclude
    extra: list[int] = []
    while len(extra) < n - len(pool):
        t = int(rng.integers(vocab))
        if t not in taken:
            taken.add(t)
            extra.append(t)
    return [int(t) for t in rng.permutation(pool)] + extra, len(extra)


def edit_delta(atoms: Atoms, tokens: list[int], change: np.ndarray) -> Tensor:
    """sum_t dc_t a_t (float64): what the edit adds to the activation."""
    return torch.from_numpy(np.asarray(change, dtype=np.float64)) @ atoms.rows[tokens]


def control_delta(atoms: Atoms, tokens: list[int], change: np.ndarray, drawn: list[int]) -> Tensor:
    """sum_i dc_i |a_{t_i}| a_{r_i} / |a_{r_i}|: each drawn coordinate moved as far as the edited one."""
    scale = torch.from_numpy(np.asarray(change, dtype=np.float64)) * atoms.norms[tokens] / atoms.norms[drawn]
    return scale @ atoms.rows[drawn]


def run_edited(model: ModelAdapter, batch: Batch, act: ActName, pos: Tensor, delta: Tensor) -> Tensor:
    """The logits at each prompt's answer position once delta [B, d] is added to act at pos [B]."""
    def fn(x: Tensor) -> Tensor:
        x = x.clone()
        rows, at = torch.arange(len(batch), device=x.device), pos.to(x.device)
        x[rows, at] = x[rows, at] + delta.to(x.device, x.dtype)
        return x
    with torch.no_grad():
        return readable(model.run(batch.tokens, interventions=[Intervention(act, fn)], logits_at=batch.last).logits)
