"""`es.inspect(model, prompt, answer=None, wrong=None, counterfactual=None)`: one prompt, looked at token by
token and head by head (docs/inspect.md).

One forward of the prompt gives every view but patching: the model's top next tokens at each position, the
logit lens per layer x position (and a tuned or Jacobian lens given as `lens`), every head's attention pattern
and, with an answer, the direct logit attribution of every head, MLP and the embedding at the last position
(its rows sum to the model's own logit difference against `wrong`). With a counterfactual, exact activation
patching of resid_pre over layer x position for the pair (inspection/patch.py). The Result's `table` is the
predictions (one row per position); the other views are its `tables` (saved beside it), and its page (and a
notebook's view of it) draws them: a token grid for each lens, small multiples of every head's attention with
a token-to-token view of the one clicked, and the attribution and patching maps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

import numpy as np
import torch
from pydantic import Field

from ..data.examples import Dataset, Example
from ..data.tokenized import tokenize_data
from ..errors import ConfigError, EntoscopeError, warn
from ..models.adapter import ModelAdapter
from ..models.footprint import FIXED
from ..models.guards import require_linear_logits
from ..models.names import ActName
from ..operation import Operation, Plan, Prepared, register_operation
from .patch import STAND_IN, patching_op, prepare_patching, run_patching
from .result import InspectResult
from .views import attention_table, dla_reads, dla_table, lens_table, predictions_table

Answer = Union[str, int, list[Union[str, int]]]
MAX_ATTENTION = 8_000_000  # attention weights one inspection keeps, tables and page (270 heads x 243 tokens)


@dataclass(frozen=True)
class InspectState:
    """What inspect's prepare resolved: the token ids, the reads of its one forward, the lens, the patching."""

    tokens: list[int]
    cf_tokens: list[int] | None
    answers: list[int] | None  # the answers' (first) token ids; None: no answer given
    wrong: list[int] | None
    reads: list[ActName]
    lens: tuple[str, Any] | None  # ("tuned" | "jacobian", the loaded lens)
    dla: bool  # direct logit attribution is computed (an answer, and logits that are a sum of parts)
    patching: tuple[Any, Any] | None  # (the Patching operation, its Prepared) with a counterfactual
    cf_forward: bool  # the counterfactual runs once on its own: its top prediction is the wrong answer
    notes: list[str] = field(default_factory=list)


@register_operation
class Inspect(Operation):
    """Inspect one prompt: predictions, logit lens grid, every head's attention, DLA and patching.

    prompt:          the prompt (text: BOS is prepended; or token ids, used as given).
    answer, wrong:   the answer token(s) and the competing one(s) (with a leading space: ' Paris'); with an
                     answer: its rank in every lens cell and the direct logit attribution at the last position.
    counterfactual:  a prompt of the same token length: exact patching of resid_pre over layer x position.
    lens:            a tuned lens folder or a Jacobian lens (.pt file or its folder): a second grid.
    top_k:           next tokens shown per position and per lens cell.
    """

    name = "inspect"
    needs_data = False
    text_fields: ClassVar[tuple[str, ...]] = ("prompt", "answer", "wrong", "counterfactual", "lens")
    prompt: Union[str, list[int]] = Field(description="the prompt: text (BOS prepended) or a list of token ids")
    answer: Answer | None = Field(default=None, description="the answer token (' Paris'), or several; its rank in "
                                  "every lens cell, and the direct logit attribution at the last position")
    wrong: Answer | None = Field(default=None, description="the competing answer token(s): attribution and "
                                 "patching read the logit difference answer - wrong")
    counterfactual: Union[str, list[int]] | None = Field(
        default=None, description="a prompt of the same token length: exact patching of resid_pre over layer x "
        "position, denoising (the counterfactual runs, the prompt's values are patched in)")
    lens: str | None = Field(default=None, description="a tuned lens folder or a Jacobian lens (.pt file or "
                             "its folder): its grid beside the logit lens's")
    top_k: int = Field(default=5, ge=1, le=20, description="next tokens shown per position and per lens cell")
    answer_scoring: Literal["first_token", "single"] = Field(
        default="first_token", description="an answer of several tokens: read by its first token, or refused")

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[InspectState]:
        if data is not None:
            raise ConfigError("inspect looks at one prompt, given as prompt (and counterfactual, answer, wrong), "
                              "not as data", code="inspect_takes_no_data",
                              remedy="pass prompt='...' (--prompt), or run an operation over the dataset")
        if self.wrong is not None and self.answer is None:
            raise ConfigError("wrong is compared with an answer, and no answer is given", code="wrong_without_answer",
                              remedy="give answer too (the logit difference is answer - wrong)")
        answers = _as_list(self.answer)
        td = tokenize_data(model, Dataset("inspect", (Example(self.prompt, self.counterfactual, answers=tuple(answers),
                                                              wrong_answers=tuple(_as_list(self.wrong))),)),
                           prepend_bos=self.prepend_bos, pairs=self.counterfactual is not None,
                           answers=bool(answers), answer_scoring=self.answer_scoring)
        tokens = td.prompts[0]
        cf_tokens = td.counterfactuals[0] if td.counterfactuals else None
        s = model.structure
        weights = s.n_layers * s.n_heads * len(tokens) * (len(tokens) + 1) // 2
        if weights > MAX_ATTENTION:
            raise ConfigError(f"the prompt is {len(tokens)} tokens: its attention view would hold {weights:,} weights "
                              f"({s.n_layers} layers x {s.n_heads} heads x the {len(tokens)} x {len(tokens)} causal "
                              f"grid), over the {MAX_ATTENTION:,} a page can show", code="inspect_prompt_too_long",
                              remedy="inspect a shorter prompt; over long texts run es.Lens or es.HeadScores")
        ans = td.answers[0] if td.answers else None
        wrong = (td.wrong_answers[0] or None) if td.wrong_answers else None
        lens = _load_lens(self.lens, model) if self.lens is not None else None
        notes: list[str] = []
        dla = ans is not None
        if dla:
            try:
                require_linear_logits(model, "direct logit attribution")
            except EntoscopeError as err:
                dla = False
                warn(f"no direct logit attribution: {err.message}", code=err.code)
        reads = [ActName(k, L) for k in ("resid_post", "pattern") for L in range(s.n_layers)]
        if dla:
            reads += [r for r in dla_reads(model) if r not in reads]
        patching = None
        cf_forward = False
        forward = 1
        if cf_tokens is not None:
            cf_forward = ans is None
            op = patching_op("logit_diff" if wrong or ans is None else "logit", self.batch_size, self.budget_bytes,
                             self.prepend_bos, self.answer_scoring)
            prepared = prepare_patching(model, op, tokens, cf_tokens, ans or [STAND_IN], wrong or
                                        ([] if ans is not None else [STAND_IN + 1]))
            patching = (op, prepared)
            forward += int(cf_forward) + prepared.plan.forward_passes
            notes += [n for n in prepared.plan.notes if n]
            if ans is None:
                notes.append("no answer given: patching reads the model's own top prediction on the prompt as the "
                             "answer and, where it differs, the counterfactual's as the wrong one")
        T, V = len(tokens), s.d_vocab
        per_run = 4 * T * (s.n_layers * (2 * s.d_model + s.n_heads * T) + 3 * V)  # the reads and the logits
        per_run += 4 * min(T * V * s.n_layers, 1 << 24) * 3  # one chunk of lens logits and its temporaries
        files = ["table.csv", "table.parquet", "lens.csv", "lens.parquet", "attention.csv", "attention.parquet"]
        files += [f"{lens[0]}_lens.csv", f"{lens[0]}_lens.parquet"] if lens else []
        files += ["dla.csv", "dla.parquet"] if dla else []
        files += ["patching.csv", "patching.parquet"] if patching else []
        plan = Plan(self.name, rows=T, forward_passes=forward, backward_passes=0,
                    batch_sizes=[1] + ([1] if cf_forward else []) + (patching[1].plan.batch_sizes if patching else []),
                    peak_memory_bytes=FIXED + per_run, examples=1, notes=notes,
                    files=files + ["index.html", "manifest.json"])
        state = InspectState(tokens, cf_tokens, ans, wrong, reads, lens, dla, patching, cf_forward, notes)
        return Prepared(model, None, plan, state)

    def execute(self, prepared: Prepared[InspectState], *, quiet: bool = False) -> InspectResult:
        model, st = prepared.model, prepared.state
        s, vocab = model.structure, model.vocab_strings()
        with torch.no_grad():
            out = model.run(torch.tensor([st.tokens]), st.reads)
        logits = out.logits[0]  # [T, V]
        answers, wrong = st.answers, st.wrong
        tables = {}
        table = predictions_table(vocab, st.tokens, logits, self.top_k, answers, wrong)
        states = {L: out[ActName("resid_post", L)][0] for L in range(s.n_layers)}
        answer = answers[0] if answers else None
        tables["lens"] = lens_table(model, "logit", states, logits, st.tokens, self.top_k, answer)
        if st.lens is not None:
            kind, lens = st.lens
            usable = {L: x for L, x in states.items() if _covers(lens, L)}
            tables[f"{kind}_lens"] = lens_table(model, kind, usable, logits, st.tokens, self.top_k, answer,
                                                lambda x, L: lens.transform(x, lens.index_of(ActName("resid_post", L))))
        patterns = np.stack([out[ActName("pattern", L)][0].float().cpu().numpy() for L in range(s.n_layers)])
        tables["attention"] = attention_table({L: torch.from_numpy(patterns[L]) for L in range(s.n_layers)})
        extra: dict[str, Any] = {"patterns": patterns, "notes": list(st.notes),
                                 "window": (s.sliding_window, list(s.sliding_layers))}
        if st.dla:
            assert answers is not None
            tables["dla"], extra["dla_terms"] = dla_table(model, out.acts, out.logits, answers, wrong)
        if st.patching is not None:
            assert st.cf_tokens is not None
            op, patch_prepared = st.patching
            if answers is None:  # the model's own predictions are the answer (and the wrong answer)
                answers = [int(logits[-1].argmax())]
                if wrong is None:
                    with torch.no_grad():
                        last = torch.tensor([len(st.cf_tokens) - 1])
                        top = int(model.run(torch.tensor([st.cf_tokens]), logits_at=last).logits[0].argmax())
                    wrong = None if top == answers[0] else [top]
                op = patching_op("logit_diff" if wrong else "logit", self.batch_size, self.budget_bytes,
                                 self.prepend_bos, self.answer_scoring)
                patch_prepared = prepare_patching(model, op, st.tokens, st.cf_tokens, answers, wrong or [])
            tables["patching"], terms = run_patching(op, patch_prepared, vocab, st.tokens, st.cf_tokens, quiet)
            extra["patching_terms"] = {**terms, "answer": vocab[answers[0]], "derived": st.answers is None,
                                       "wrong": vocab[wrong[0]] if wrong else None}
        extra["answer"] = vocab[st.answers[0]] if st.answers else None
        extra["wrong"] = vocab[st.wrong[0]] if st.wrong else None
        return InspectResult(self.name, table, tables=tables, extra=extra,
                             title=f"inspect: {_short(vocab, st.tokens)}", structure=s)


def inspect(model: Any, prompt: str | list[int], answer: Answer | None = None, wrong: Answer | None = None,
            counterfactual: str | list[int] | None = None, *, lens: str | None = None, top_k: int = 5,
            quiet: bool = True, **options: Any) -> InspectResult:
    """Inspect one prompt on `model` (any accepted kind): the model's top next tokens at each position, the logit
    lens per layer x position (and `lens`: a tuned or Jacobian lens file), every head's attention pattern, and,
    with an answer, the direct logit attribution at the last position against `wrong`; with a counterfactual,
    exact patching of resid_pre over layer x position. Returns a Result: `.table` (the predictions), `.tables`
    (lens, attention, dla, patching), `.save(folder)` (its page), and, in a notebook, the view itself.

        r = es.inspect(model, "The Eiffel Tower is in the city of", answer=" Paris", wrong=" Rome")
        r.dla.sort_values("contribution").tail()
    Other options (prepend_bos, answer_scoring, batch_size, ...) are the `Inspect` operation's fields."""
    op = Inspect(prompt=prompt, answer=answer, wrong=wrong, counterfactual=counterfactual, lens=lens, top_k=top_k,
                 **options)
    return op.run(model, quiet=quiet)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _short(vocab: Any, tokens: list[int], limit: int = 60) -> str:
    text = "".join(vocab.take(tokens[1:] if len(tokens) > 1 else tokens))
    return repr(text if len(text) <= limit else "..." + text[-limit:])


def _covers(lens: Any, layer: int) -> bool:
    """Whether a tuned / Jacobian lens reads resid_post of `layer` (a Jacobian lens holds the layers it was fit on)."""
    try:
        lens.index_of(ActName("resid_post", layer))
    except ConfigError:
        return False
    return True


def _load_lens(path: str, model: ModelAdapter) -> tuple[str, Any]:
    """A tuned lens (a folder with config.json) or a Jacobian lens (a .pt file, or a folder with lens.pt), checked
    against the model."""
    from ..lens.jacobian import FILE, JacobianLens
    from ..lens.tuned import TunedLens

    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"lens {p} does not exist", code="lens_not_found",
                          remedy="give a tuned lens folder or a Jacobian lens file (entoscope train-lens --out DIR)")
    if p.is_dir() and (p / "config.json").exists():
        tuned = TunedLens.load(p)
        tuned.check_model(model)
        return "tuned", tuned.to(model.device)
    if p.suffix == ".pt" or (p.is_dir() and (p / FILE).exists()):
        jacobian = JacobianLens.load(p)
        jacobian.check_model(model)
        return "jacobian", jacobian
    raise ConfigError(f"{p} is neither a tuned lens (a folder with config.json) nor a Jacobian lens (a .pt file or a "
                      f"folder with {FILE})", code="lens_unknown",
                      remedy="give the folder `entoscope train-lens --out DIR` wrote (--method tuned or jacobian)")
