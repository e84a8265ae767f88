"""`ModelAdapter`: entoscope's one view of any accepted model.

Accepted: a TransformerBridge (plain or in compatibility mode), a HookedTransformer, an nnsight
LanguageModel, or any of them wrapped in `CachedModel`. Everything an operation needs goes through
here: the structure record, tokenising, runs that read activations, runs with interventions, and the
weights. What differs between kinds of model sits behind `Backend` (backend.py, one class per kind);
this class only names, lowers derived sites to base ones, and checks.

Padding: operations batch prompts right-padded with no attention mask. Attention is causal, so a
real token never attends to a later pad and sits at the same position as when run alone: its
activations equal a one-prompt run. Values at pad positions are meaningless and are never read.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from ..errors import DataError, SiteError
from . import features
from .backend import Backend, BaseIntervention, backend_for
from .guards import (CheckedWeights, check_describable, check_finite_weights, check_unembedding, evaluating,
                     first_non_finite, non_finite, raise_non_finite, unembedding_checked)
from .names import KINDS, ActName, parse_name
from .post_norms import head_outputs, post_scale_reads
from .vocabulary import Vocabulary, vocabulary
from .weights import Weights

InterventionFn = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Intervention:
    """Change one activation during a run: `fn(activation) -> new activation` (same shape).

    The activation arrives in the canonical layout of its kind (see names.KINDS: batch first).
    Use `Intervention.replace`/`.add` for the common cases.
    """

    act: ActName | str
    fn: InterventionFn

    @staticmethod
    def replace(act: ActName | str, value: Tensor, index: Any = ...) -> Intervention:
        """Set `activation[index] = value` (value broadcast to the indexed shape)."""
        def fn(x: Tensor) -> Tensor:
            x = x.clone()
            x[index] = value.to(x.dtype)
            return x
        return Intervention(act, fn)

    @staticmethod
    def add(act: ActName | str, value: Tensor, index: Any = ...) -> Intervention:
        """Add `value` to `activation[index]`."""
        def fn(x: Tensor) -> Tensor:
            x = x.clone()
            x[index] = x[index] + value.to(x.dtype)
            return x
        return Intervention(act, fn)


@dataclass
class RunOutput:
    """What a run returns: the logits [batch, pos, vocab] (None for a run with logits=False) and the
    activations asked for."""

    logits: Tensor | None
    acts: dict[ActName, Tensor] = field(default_factory=dict)

    def __getitem__(self, name: ActName | str) -> Tensor:
        key = name if isinstance(name, ActName) else parse_name(name)
        if key not in self.acts:
            raise KeyError(f"{key} was not read in this run; read: {sorted(map(str, self.acts))}")
        return self.acts[key]


def _split(model: Any) -> tuple[Any, Any]:
    """(the model itself, the CachedModel around it or None)."""
    if getattr(type(model), "_entoscope_wrapper", False):
        return model.model, model
    return model, None


def module_of(model: Any) -> Any:
    """The torch module that holds a model's weights: the TransformerLens model, or the HuggingFace
    model inside an nnsight one (CachedModel and ModelAdapter unwrapped)."""
    if isinstance(model, ModelAdapter):
        return model.module
    inner, _ = _split(model)
    from .nnsight_backend import NNsightBackend

    return inner.__dict__["_module"] if NNsightBackend.accepts(inner) else inner


def unwrap(model: Any) -> tuple[Any, Any]:
    """(the module holding the weights, the object to call run_with_cache on: a CachedModel if any)."""
    if isinstance(model, ModelAdapter):
        return model.module, model.runner
    inner, cached = _split(model)
    return module_of(inner), cached if cached is not None else inner


class ModelAdapter:
    """A uniform view of a model. Build with `adapt(model)`.

    `backend` is the model's `Backend` (backend.py: a TransformerBridge, a HookedTransformer, an nnsight
    LanguageModel; its kind is `structure.backend`); `module` the torch module that holds its weights (the
    TransformerLens model, or the HuggingFace model inside an nnsight one); `runner` what cached reads
    call (a CachedModel where the model is wrapped in one)."""

    def __init__(self, model: Any) -> None:
        inner, cached = _split(model)
        self.backend: Backend = backend_for(inner)
        self.model = inner
        self.module = self.backend.module
        self.runner = cached if cached is not None else self.backend.runner
        self.structure = self.backend.structure()
        quantization = getattr(self.module, "_entoscope_quantization", None)  # models/gguf.py, set at load
        if quantization is not None:
            self.structure = dataclasses.replace(self.structure, quantization=quantization)
        # the unembedding is handed out once the logits are shown to be unembed(final_norm(last resid_post))
        self.weights = cast(Weights, CheckedWeights(self.backend.weights(self.structure), self.check_unembedding))
        check_finite_weights(self.module)
        self.backend.check_sites(self.structure)
        check_describable(self)
        self._unembedding_ok = unembedding_checked(self)

    def check_unembedding(self, final: Tensor | None = None, logits: Tensor | None = None) -> None:
        """Show once per weights version that this model's logits are unembed(final_norm(last resid_post))
        (guards.check_unembedding): on `final` and `logits` of a forward made anyway, else by its own forward."""
        if not self._unembedding_ok:
            check_unembedding(self, final, logits)
            self._unembedding_ok = True

    def evaluating(self) -> Any:
        """Context: the model in eval mode (dropout off), each module's own mode restored after."""
        return evaluating(self.module)

    @property
    def tl(self) -> Any:
        """The old name of `module` (kept for code written against it; it is not a TransformerLens model
        for an nnsight one)."""
        return self.module

    @property
    def impl(self) -> Backend:
        """The old name of `backend`."""
        return self.backend

    # ------------------------------------------------------------------ names
    @property
    def name(self) -> str:
        return self.backend.model_name or self.structure.architecture

    def resolve(self, name: ActName | str) -> ActName:
        """Canonical name for `name` (aliases accepted), validated against this model."""
        act = parse_name(name, self.structure.n_layers)
        s = self.structure
        if act.kind == "features":
            return features.resolve(self, act)
        if act.kind == "resid_post" and act.layer == -1:
            act = ActName("resid_post", s.n_layers - 1)
        if act.layer is not None and not 0 <= act.layer < s.n_layers:
            raise SiteError(f"{name}: layer {act.layer} is out of range", code="site_out_of_range",
                            remedy=f"this model has layers 0..{s.n_layers - 1} (negative counts from the end)")
        if act.kind == "resid_mid" and s.parallel:
            raise SiteError(f"{name}: this model runs attention and MLP in parallel, so there is no "
                            "residual stream between them", code="no_resid_mid",
                            remedy="use resid_pre.L (what both attention and MLP read) or resid_post.L")
        if act.kind == "pos_embed" and s.positional != "learned":
            raise SiteError(f"{name}: this model has rotary positions: nothing is added to the residual "
                            "stream for position", code="no_learned_positions",
                            remedy="positions enter through q and k; read q.L/k.L, or embed")
        if act.kind in ("ln1_post_scale", "ln2_post_scale") and not s.post_norms:
            raise SiteError(f"{name}: {s.architecture} has no norm after its attention and MLP", code="no_post_norm",
                            remedy="post-norm scales exist on Gemma 2/3 only; read ln1_scale / ln2_scale (pre-norms)")
        self.backend.check_servable(act)
        return act

    def hook_name(self, name: ActName | str) -> str:
        """The backend's name for an activation (a TransformerLens hook name; the canonical name under nnsight);
        derived ones have none (result, logits). Refuses what this model cannot serve."""
        act = self.resolve(name)
        if act.kind == "features":
            return self.hook_name(features.dictionary(act).hook_out)  # where feature writes go
        if act.kind in ("result", "logits"):
            raise SiteError(f"{act} is computed by entoscope, not read from one hook",
                            code="no_single_hook", remedy="read it through ModelAdapter.run")
        if self._needs_unfolded_norm(act):
            raise SiteError(f"{act}: this HookedTransformer was loaded without processing, so its norm "
                            "output has no hook", code="no_single_hook",
                            remedy="load it with TransformerLens's processing (HookedTransformer.from_pretrained)")
        return self.backend.key(act)

    def _needs_unfolded_norm(self, act: ActName) -> bool:
        return self.backend.computes_norm(act, self.structure)

    # ------------------------------------------------------------------ tokens
    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def bos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "bos_token_id", None)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def unembedding_dtype(self) -> torch.dtype:
        """W_U's dtype, read without waiting for the unembedding check (a plan reads it and makes no forward)."""
        return cast(CheckedWeights, self.weights).unchecked.W_U.dtype

    def tokenize(self, text: str | Sequence[int], prepend_bos: bool = True) -> list[int]:
        """Token ids for one prompt.

        entoscope calls the tokenizer WITHOUT its special tokens and prepends the BOS id itself
        when `prepend_bos` (the default, as TransformerLens's `to_tokens`); a raw HuggingFace
        tokenizer call would add whatever its template says. A sequence of ints is used as given.
        """
        if not isinstance(text, str):
            return [int(t) for t in text]
        ids = list(_encoded(self.tokenizer, text))
        if prepend_bos:
            if self.bos_token_id is None:
                raise DataError("this tokenizer has no BOS token to prepend", code="no_bos_token",
                                remedy="pass prepend_bos=False")
            ids = [int(self.bos_token_id)] + ids
        return ids

    def token_id(self, token: str | int) -> int:
        """The id of one answer token; an answer that is several tokens is refused."""
        if isinstance(token, int):
            if not 0 <= token < self.structure.d_vocab:
                raise DataError(f"token id {token} is outside the vocabulary (0..{self.structure.d_vocab - 1})",
                                code="token_out_of_range", remedy="check the answer ids")
            return token
        ids = self.tokenize(token, prepend_bos=False)
        if len(ids) != 1:
            pieces = [self.tokenizer.decode([i]) for i in ids]
            raise DataError(f"the answer {token!r} is {len(ids)} tokens under this tokenizer: {pieces}",
                            code="multi_token_answer",
                            remedy="use a single-token answer (mind the leading space, e.g. ' Mary'), or "
                            "choose how to score several tokens (answer_scoring='first_token')")
        return ids[0]

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        vocab = self.vocab_strings()
        return [vocab[int(i)] for i in ids]

    def vocab_strings(self) -> Vocabulary:
        """Every token id's text, decoded on its own when first asked for (vocabulary.py: kept on the tokenizer;
        control characters written as escapes, `\\x00`)."""
        return vocabulary(self.tokenizer, self.structure.d_vocab)

    # ------------------------------------------------------------------ runs
    def run(self, tokens: Tensor, read: Iterable[ActName | str] = (), *,
            interventions: Sequence[Intervention] = (), grad: bool = False, logits: bool = True,
            logits_at: Tensor | None = None) -> RunOutput:
        """One batched forward pass: logits and the activations named in `read`.

        With logits=False a read-only run stops after the last block it reads (TransformerLens's
        stop_at_layer; nnsight's tracer.stop), skipping the later blocks, the final norm and the
        unembedding; `.logits` is None. (A bridge cannot stop after its last block: there HuggingFace is
        asked for the last position's logits only, `logits_to_keep=1`, where its forward takes that argument.)
        With `logits_at` (one position per row, [B]) `.logits` holds only those rows' logits, [B, d_vocab]
        (a read-only run unembeds the positions from the earliest of them on only, where it can).

        Without interventions or gradients the run goes through the runner's `run_with_cache` (so a
        CachedModel serves it from disk); otherwise through the backend's own run, never cached. With
        `grad=True` the returned activations are part of the autograd graph (torch.autograd.grad works on
        them). Activations read at a site that is also intervened on are the values after the change.
        """
        tokens = tokens.to(self.device)
        acts = [self.resolve(n) for n in read]
        ivs = self.lower([Intervention(self.resolve(iv.act), iv.fn) for iv in interventions])
        bases: dict[ActName, None] = {}
        for act in acts:
            for base in self._sources(act):
                bases[base] = None
        logits = logits or logits_at is not None
        # the unembedding check rides on the first forward that returns the model's own logits (the last
        # block's output is read beside them); any other forward waits for its own check forward first
        final = ActName("resid_post", self.structure.n_layers - 1)
        witness = not self._unembedding_ok and logits and not ivs and self.runner is self.backend.runner
        if witness:
            bases[final] = None
        elif not self._unembedding_ok:
            self.check_unembedding()
        with torch.set_grad_enabled(grad):  # derived reads (result, unfolded norms) too
            kept = tokens.shape[1]  # positions HuggingFace unembeds (the last ones)
            if not ivs and not grad:
                stop = None if logits else self._stop_layer(list(bases))
                kw: dict[str, Any] = {} if stop is None else {"stop_at_layer": stop}
                if (not logits or logits_at is not None) and self.backend.keeps_last_logits():
                    kept = 1 if not logits else kept - int(logits_at.min())
                    kw["logits_to_keep"] = kept
                keys = {self.backend.key(b): b for b in bases}
                out_logits, cache = self.runner.run_with_cache(
                    tokens, names_filter=sorted(keys), return_type="logits", **kw)
                raw = {base: cache[k] for k, base in keys.items()}
            else:
                out_logits, raw = self.backend.run(tokens, list(bases), ivs)
            out = {act: self._derive(act, raw) for act in acts}
        if logits_at is not None:
            rows = torch.arange(len(logits_at), device=out_logits.device)
            out_logits = out_logits[rows, logits_at.to(out_logits.device) - (tokens.shape[1] - kept)]
        self._check_finite(tokens, ivs, out_logits if logits else None, out)
        if witness:  # the first row's last positions (or its logits_at position)
            if logits_at is None:
                k = min(4, out_logits.shape[1])
                self.check_unembedding(raw[final][0, -k:], out_logits[0, -k:])
            else:
                self.check_unembedding(raw[final][0, int(logits_at[0])][None], out_logits[:1])
        return RunOutput(out_logits if logits else None, out)

    def _check_finite(self, tokens: Tensor, ivs: list[BaseIntervention], logits: Tensor | None,
                      acts: dict[ActName, Tensor]) -> None:
        """NaN/inf in what a run returns is an error naming the first site where it appears."""
        # attention scores hold -inf above the diagonal (the causal mask) by design
        named = [(str(a), t) for a, t in acts.items() if a.kind != "attn_scores"]
        if logits is not None:
            named.append(("logits", logits))
        bad = [named[i][0] for i in non_finite([t for _, t in named])]
        if bad:
            raise_non_finite(f"this run's {', '.join(bad)}", first_non_finite(self, tokens, ivs))

    def _stop_layer(self, reads: list[ActName]) -> int | None:
        """The block after the last one `reads` needs, or None when a read comes after every block."""
        if any(a.layer is None and a.kind not in ("embed", "pos_embed") for a in reads):
            return None
        return max((a.layer + 1 for a in reads if a.layer is not None), default=1)

    def _sources(self, act: ActName) -> list[ActName]:
        if act.kind == "logits":
            return []
        if act.kind == "features":
            return self._sources(self.resolve(features.source(act)))
        if act.kind == "result":
            return [ActName("z", act.layer)] + post_scale_reads(self.structure, act.layer, "attn")
        if self._needs_unfolded_norm(act):
            return [ActName("resid_pre" if act.kind == "attn_in" or self.structure.parallel else "resid_mid",
                            act.layer)]
        return [act]

    def _derive(self, act: ActName, raw: dict[ActName, Tensor]) -> Tensor:
        if act.kind == "features":
            return features.encode(act, self._derive(self.resolve(features.source(act)), raw))
        if act.kind == "result":
            z = raw[ActName("z", act.layer)]
            return head_outputs(self, act.layer, z, raw.get(ActName("ln1_post_scale", act.layer)))
        if self._needs_unfolded_norm(act):
            src = raw[self._sources(act)[0]]
            return self.weights.norm(act.layer, "ln1" if act.kind == "attn_in" else "ln2")(src)
        if act.kind == "logits":
            raise AssertionError("logits are returned as RunOutput.logits")
        return raw[act]

    def lower(self, ivs: Sequence[Intervention]) -> list[BaseIntervention]:
        """Interventions at base sites (what a backend applies) for `ivs`: canonical names (resolved), or
        the attention taps rot_q.L / rot_k.L. A head's result and a dictionary's features are written
        through the sites they are computed from."""
        out: list[BaseIntervention] = []
        for iv in ivs:
            act = iv.act
            assert isinstance(act, ActName)
            if act.kind == "logits":
                raise SiteError("logits cannot be intervened on", code="site_not_writable",
                                remedy="intervene on resid_post of the last layer, or edit the logits yourself")
            if act.kind == "result":
                out.extend(self._result_writes(act, iv.fn))
            elif act.kind == "features":
                out.extend(features.interventions(act, iv.fn))
            elif self._needs_unfolded_norm(act):
                raise SiteError(f"{act} cannot be written on an unprocessed HookedTransformer",
                                code="site_not_writable", remedy="use resid_pre/resid_mid, or a processed model")
            else:
                out.append((act, iv.fn))
        return out

    def _result_writes(self, act: ActName, fn: InterventionFn) -> list[BaseIntervention]:
        """Writing a head's result: attn_out += sum_h (new_result_h - result_h); result from z (and, under a
        post-attention norm, that norm's scale of this run, frozen: the write adds to the post-normed attn_out
        and the norm is not recomputed; to patch with the norm recomputed, write z)."""
        stash: dict[str, Tensor] = {}
        layer = act.layer
        assert layer is not None

        def keep(key: str) -> Callable[[Tensor], None]:
            def fn_keep(x: Tensor) -> None:
                stash[key] = x
            return fn_keep

        def edit_out(out: Tensor) -> Tensor:
            result = head_outputs(self, layer, stash.pop("z"), stash.pop("scale", None)).to(out.dtype)
            return out + (fn(result) - result).sum(dim=2)
        return [(ActName("z", layer), keep("z")),
                *[(scale, keep("scale")) for scale in post_scale_reads(self.structure, layer, "attn")],
                (ActName("attn_out", layer), edit_out)]

    # ------------------------------------------------------------------ misc
    def axis_sizes(self, kind: str | ActName, seq_len: int | None = None) -> dict[str, int]:
        """Size of each axis of an activation kind (the sites grid validates against these); a features
        activation is named in full (its width is its dictionary's)."""
        s = self.structure
        sizes = {"pos": seq_len or s.n_ctx, "query_pos": seq_len or s.n_ctx, "key_pos": seq_len or s.n_ctx,
                 "d_model": s.d_model, "head": s.n_heads, "kv_head": s.n_kv_heads, "d_head": s.d_head,
                 "neuron": s.d_mlp, "vocab": s.d_vocab, "one": 1}
        if isinstance(kind, ActName):
            if kind.kind == "features":
                sizes["feature"] = features.width(kind)
            kind = kind.kind
        return {ax: sizes[ax] for ax in KINDS[kind].axes}


_ENCODED_KEPT = 1 << 16  # texts whose ids a tokenizer keeps (datasets repeat names, answers and templates)


def _encoded(tokenizer: Any, text: str) -> tuple[int, ...]:
    """The tokenizer's ids for `text` without special tokens, remembered on the tokenizer (as vocab_strings
    is) and forgotten when its vocabulary grows (added tokens)."""
    size = len(tokenizer)
    memo = tokenizer.__dict__.get("_entoscope_encoded")
    if memo is None or memo[0] != size or len(memo[1]) >= _ENCODED_KEPT:
        memo = tokenizer._entoscope_encoded = (size, {})
    ids = memo[1].get(text)
    if ids is None:
        ids = memo[1][text] = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


def adapt(model: Any) -> ModelAdapter:
    """The adapter for any accepted model (an adapter is returned as is)."""
    if isinstance(model, ModelAdapter):
        return model
    return ModelAdapter(model)
