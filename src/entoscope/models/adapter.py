"""`ModelAdapter`: entoscope's one view of any accepted model. The only class that talks to TransformerLens.

Accepted: a TransformerBridge (plain or in compatibility mode), a HookedTransformer, or either
wrapped in `CachedModel`. Everything an operation needs goes through here: the structure record,
tokenising, runs that read activations, runs with interventions, and the weights.

Padding: operations batch prompts right-padded with no attention mask. Attention is causal, so a
real token never attends to a later pad and sits at the same position as when run alone: its
activations equal a one-prompt run. Values at pad positions are meaningless and are never read.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import DataError, SiteError, UnsupportedModelError
from . import features
from .guards import check_describable, check_finite_weights, evaluating, first_non_finite, raise_non_finite
from .names import KINDS, ActName, parse_name
from .structure import Structure
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


def _backend_of(tl: Any) -> str:
    try:
        from transformer_lens.model_bridge import TransformerBridge
        if isinstance(tl, TransformerBridge):
            return "bridge"
    except ImportError:  # pragma: no cover - every supported release has the bridge
        pass
    try:
        from transformer_lens import HookedTransformer
        if isinstance(tl, HookedTransformer):
            return "hooked"
    except ImportError:  # transformer-lens 4.x has no HookedTransformer
        pass
    raise UnsupportedModelError(
        f"entoscope accepts a TransformerLens TransformerBridge or HookedTransformer (optionally in "
        f"entoscope.CachedModel), not {type(tl).__module__}.{type(tl).__name__}",
        remedy="wrap a HuggingFace model first: TransformerBridge.boot_transformers(name) or "
        "entoscope.load_model(name)",
    )


def unwrap(model: Any) -> tuple[Any, Any]:
    """(the TransformerLens model, the object to call run_with_cache on: a CachedModel if any)."""
    if isinstance(model, ModelAdapter):
        return model.tl, model.runner
    if getattr(type(model), "_entoscope_wrapper", False):
        return model.model, model
    return model, model


class ModelAdapter:
    """A uniform view of a TransformerLens model. Build with `adapt(model)`."""

    def __init__(self, model: Any) -> None:
        self.tl, self.runner = unwrap(model)
        self.backend = _backend_of(self.tl)
        self.structure = self._describe()
        self.weights = Weights(self.tl, self.structure)
        self._check_hooks()
        check_finite_weights(self.tl)
        check_describable(self)

    def evaluating(self) -> Any:
        """Context: the model in eval mode (dropout off), each module's own mode restored after."""
        return evaluating(self.tl)

    # ------------------------------------------------------------------ structure
    def _describe(self) -> Structure:
        cfg = self.tl.cfg
        missing = [f for f in ("n_layers", "n_heads", "d_model", "d_head", "d_vocab") if
                   getattr(cfg, f, None) in (None, -1)]
        if missing or not hasattr(self.tl, "blocks"):
            raise UnsupportedModelError(
                f"cannot describe this model: its config lacks {', '.join(missing) or 'blocks'}",
                remedy="entoscope supports decoder-only transformers with attention and MLP blocks "
                "(GPT-2, GPT-NeoX/Pythia, Llama, Qwen2, Mistral and what TransformerBridge maps alike)",
            )
        norm_type = str(getattr(cfg, "normalization_type", None))
        if norm_type not in ("LN", "LNPre", "RMS", "RMSPre"):
            raise UnsupportedModelError(
                f"cannot describe this model's normalisation {norm_type!r}",
                remedy="entoscope knows LayerNorm and RMSNorm models (pre-norm)")
        pos = str(getattr(cfg, "positional_embedding_type", "standard"))
        if pos not in ("standard", "rotary"):
            raise UnsupportedModelError(f"cannot describe positional embedding type {pos!r}",
                                        remedy="entoscope knows learned ('standard') and rotary positions")
        if self.backend == "bridge":
            compat = bool(getattr(self.tl, "compatibility_mode", False))
            mode = "compat" if compat else "plain"
            folded = compat and self._norms_are_identity()
        else:
            folded = norm_type.endswith("Pre")
            mode = "processed" if folded else "unprocessed"
        n_heads = int(cfg.n_heads)
        n_kv = getattr(cfg, "n_key_value_heads", None) or n_heads
        arch = getattr(cfg, "architecture", None) or getattr(cfg, "original_architecture", None) or "unknown"
        tied = self._tied()
        return Structure(
            architecture=str(arch), n_layers=int(cfg.n_layers), n_heads=n_heads, n_kv_heads=int(n_kv),
            d_model=int(cfg.d_model), d_head=int(cfg.d_head), d_mlp=int(getattr(cfg, "d_mlp", 0) or 0),
            d_vocab=int(cfg.d_vocab), n_ctx=int(cfg.n_ctx),
            norm="rmsnorm" if norm_type.startswith("RMS") else "layernorm", norm_folded=folded,
            positional="rotary" if pos == "rotary" else "learned",
            parallel=bool(getattr(cfg, "parallel_attn_mlp", False)),
            gated_mlp=bool(getattr(cfg, "gated_mlp", False)), act_fn=str(getattr(cfg, "act_fn", "")),
            backend=self.backend, mode=mode, tied_embeddings=tied,
        )

    def _norms_are_identity(self) -> bool:
        """Compatibility mode folds each norm's weight into the next matrices and leaves weight 1, bias 0."""
        mods = [self.tl.ln_final] + [getattr(b, ln) for b in self.tl.blocks for ln in ("ln1", "ln2")]
        for mod in mods:
            for name, p in mod.named_parameters():
                target = 1.0 if name.endswith("weight") or name.endswith("w") else 0.0
                if not torch.all(p == target):
                    return False
        return True

    def _tied(self) -> bool:
        if self.backend == "bridge":
            hf_cfg = getattr(getattr(self.tl, "original_model", None), "config", None)
            return bool(getattr(hf_cfg, "tie_word_embeddings", False))
        return False  # HookedTransformer keeps separate W_E and W_U

    def _check_hooks(self) -> None:
        """Refuse at load time a model whose hooks do not carry what the layer needs."""
        names = set(self.tl.hook_dict.keys())
        needed = ["resid_pre", "resid_post", "attn_out", "mlp_out", "z", "pattern", "q", "k", "v"]
        lacking = [k for k in needed if self._hook(ActName(k, 0)) not in names]
        if lacking:
            raise UnsupportedModelError(
                f"this model does not expose the hooks entoscope needs for {', '.join(lacking)} "
                f"(looked for {', '.join(self._hook(ActName(k, 0)) for k in lacking)})",
                remedy="use an architecture TransformerBridge maps fully (GPT-2, NeoX, Llama, Qwen2, ...)",
            )

    # ------------------------------------------------------------------ names
    @property
    def name(self) -> str:
        return str(getattr(self.tl.cfg, "model_name", None) or self.structure.architecture)

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
        return act

    def _hook(self, act: ActName) -> str:
        L = act.layer
        if act.kind in ("attn_in", "mlp_in"):
            ln = "ln1" if act.kind == "attn_in" else "ln2"
            return f"blocks.{L}.{ln}.hook_out" if self.backend == "bridge" else f"blocks.{L}.{ln}.hook_normalized"
        table = {
            "embed": "hook_embed", "pos_embed": "hook_pos_embed", "final_scale": "ln_final.hook_scale",
            "resid_pre": "blocks.{L}.hook_resid_pre", "resid_mid": "blocks.{L}.hook_resid_mid",
            "resid_post": "blocks.{L}.hook_resid_post", "attn_out": "blocks.{L}.hook_attn_out",
            "mlp_out": "blocks.{L}.hook_mlp_out", "ln1_scale": "blocks.{L}.ln1.hook_scale",
            "ln2_scale": "blocks.{L}.ln2.hook_scale", "q": "blocks.{L}.attn.hook_q",
            "k": "blocks.{L}.attn.hook_k", "v": "blocks.{L}.attn.hook_v", "z": "blocks.{L}.attn.hook_z",
            "attn_scores": "blocks.{L}.attn.hook_attn_scores", "pattern": "blocks.{L}.attn.hook_pattern",
            "mlp_pre": "blocks.{L}.mlp.hook_pre", "mlp_post": "blocks.{L}.mlp.hook_post",
        }
        return table[act.kind].format(L=L)

    def hook_name(self, name: ActName | str) -> str:
        """The backend's hook name for an activation (derived ones have none: result, logits)."""
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
        return self._hook(act)

    def _needs_unfolded_norm(self, act: ActName) -> bool:
        return act.kind in ("attn_in", "mlp_in") and self.backend == "hooked" and not self.structure.norm_folded

    # ------------------------------------------------------------------ tokens
    @property
    def tokenizer(self) -> Any:
        return self.tl.tokenizer

    @property
    def bos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "bos_token_id", None)

    @property
    def device(self) -> torch.device:
        return next(self.tl.parameters()).device

    def tokenize(self, text: str | Sequence[int], prepend_bos: bool = True) -> list[int]:
        """Token ids for one prompt.

        entoscope calls the tokenizer WITHOUT its special tokens and prepends the BOS id itself
        when `prepend_bos` (the default, as TransformerLens's `to_tokens`); a raw HuggingFace
        tokenizer call would add whatever its template says. A sequence of ints is used as given.
        """
        if not isinstance(text, str):
            return [int(t) for t in text]
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
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

    def vocab_strings(self) -> list[str]:
        """Every token id decoded on its own, for tables and pages (computed once per tokenizer, kept on
        it). Control characters (byte tokens such as NUL) are written as escapes, `\\x00`, so that no
        table cell or page holds a raw control character."""
        n = self.structure.d_vocab
        vocab = getattr(self.tokenizer, "_entoscope_vocab", None)
        if vocab is None or len(vocab) != n:
            known = min(n, len(self.tokenizer))
            vocab = [_printable(self.tokenizer.decode([i])) for i in range(known)] + \
                [f"<{i}>" for i in range(known, n)]
            self.tokenizer._entoscope_vocab = vocab
        return vocab

    # ------------------------------------------------------------------ runs
    def run(self, tokens: Tensor, read: Iterable[ActName | str] = (), *,
            interventions: Sequence[Intervention] = (), grad: bool = False, logits: bool = True,
            logits_at: Tensor | None = None) -> RunOutput:
        """One batched forward pass: logits and the activations named in `read`.

        With logits=False a read-only run stops after the last block it reads (TransformerLens's
        stop_at_layer), skipping the later blocks, the final norm and the unembedding; `.logits` is None.
        (A bridge cannot stop after its last block: there HuggingFace is asked for the last position's
        logits only, `logits_to_keep=1`, where its forward takes that argument.)
        With `logits_at` (one position per row, [B]) `.logits` holds only those rows' logits, [B, d_vocab]
        (a read-only bridge run unembeds the positions from the earliest of them on only).

        Without interventions or gradients the run goes through `run_with_cache` (so a CachedModel
        serves it from disk); otherwise through `run_with_hooks`, never cached. With `grad=True`
        the returned activations are part of the autograd graph (torch.autograd.grad works on them).
        Activations read at a site that is also intervened on are the values after the change.
        """
        tokens = tokens.to(self.device)
        acts = [self.resolve(n) for n in read]
        ivs = [Intervention(self.resolve(iv.act), iv.fn) for iv in interventions]
        hooks_needed: dict[str, ActName] = {}
        for act in acts:
            for base in self._sources(act):
                hooks_needed[self._hook(base)] = base
        with torch.set_grad_enabled(grad):  # derived reads (result, unfolded norms) too
            logits = logits or logits_at is not None
            stop = None if logits or ivs or grad else self._stop_layer(list(hooks_needed.values()))
            kept = tokens.shape[1]  # positions HuggingFace unembeds (the last ones)
            fwd_hooks = self.intervention_hooks(ivs)
            if not ivs and not grad:
                kw: dict[str, Any] = {} if stop is None else {"stop_at_layer": stop}
                if (not logits or logits_at is not None) and self._keeps_last_logits():
                    kept = 1 if not logits else kept - int(logits_at.min())
                    kw["logits_to_keep"] = kept
                out_logits, cache = self.runner.run_with_cache(
                    tokens, names_filter=sorted(hooks_needed), return_type="logits", **kw)
                raw = {base: cache[h] for h, base in hooks_needed.items()}
            else:
                raw = {}
                for h, base in hooks_needed.items():
                    fwd_hooks.append((h, self._saver(raw, base)))
                out_logits = self.tl.run_with_hooks(tokens, fwd_hooks=fwd_hooks, return_type="logits")
            out = {act: self._derive(act, raw) for act in acts}
        if logits_at is not None:
            rows = torch.arange(len(logits_at), device=out_logits.device)
            out_logits = out_logits[rows, logits_at.to(out_logits.device) - (tokens.shape[1] - kept)]
        self._check_finite(tokens, fwd_hooks if ivs else [], out_logits if logits else None, out)
        return RunOutput(out_logits if logits else None, out)

    def _keeps_last_logits(self) -> bool:
        """Whether this bridge's HuggingFace forward can unembed the last position only (logits_to_keep)."""
        if self.backend != "bridge":
            return False
        forward = getattr(getattr(self.tl, "original_model", None), "forward", None)
        try:
            return "logits_to_keep" in inspect.signature(forward).parameters
        except (TypeError, ValueError):
            return False

    def _check_finite(self, tokens: Tensor, fwd_hooks: list, logits: Tensor | None, acts: dict[ActName, Tensor]) -> None:
        """NaN/inf in what a run returns is an error naming the first hook point where it appears."""
        # attention scores hold -inf above the diagonal (the causal mask) by design
        bad = [str(a) for a, t in acts.items() if a.kind != "attn_scores" and t.is_floating_point()
               and not bool(torch.isfinite(t.detach()).all())]
        if logits is not None and not bool(torch.isfinite(logits.detach()).all()):
            bad.append("logits")
        if bad:
            raise_non_finite(f"this run's {', '.join(bad)}",
                             first_non_finite(self.tl, tokens, fwd_hooks, self._watchable_hooks()))

    def _watchable_hooks(self) -> dict[str, str]:
        """Hook name -> canonical name of every activation this model has (where a NaN can be located)."""
        out = {}
        for kind, k in KINDS.items():
            for L in range(self.structure.n_layers) if k.per_layer else [None]:
                try:
                    out[self.hook_name(ActName(kind, L))] = str(ActName(kind, L))
                except Exception:  # noqa: BLE001 - a kind this model has no hook for
                    continue
        return {h: n for h, n in out.items() if h in self.tl.hook_dict}

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
            return [ActName("z", act.layer)]
        if self._needs_unfolded_norm(act):
            return [ActName("resid_pre" if act.kind == "attn_in" or self.structure.parallel else "resid_mid",
                            act.layer)]
        return [act]

    def _derive(self, act: ActName, raw: dict[ActName, Tensor]) -> Tensor:
        if act.kind == "features":
            return features.encode(act, self._derive(self.resolve(features.source(act)), raw))
        if act.kind == "result":
            z = raw[ActName("z", act.layer)]
            return torch.einsum("bphd,hdm->bphm", z, self.weights.W_O(act.layer).to(z.dtype))
        if self._needs_unfolded_norm(act):
            src = raw[self._sources(act)[0]]
            return self.weights.norm(act.layer, "ln1" if act.kind == "attn_in" else "ln2")(src)
        if act.kind == "logits":
            raise AssertionError("logits are returned as RunOutput.logits")
        return raw[act]

    @staticmethod
    def _saver(store: dict[ActName, Tensor], act: ActName) -> Callable:
        # Returning x matters: the bridge hands some hooks (q, k, v, z) a reshaped copy and only a
        # returned tensor flows on, so a stored-but-not-returned copy would be off the autograd path.
        def hook(x: Tensor, hook: Any = None) -> Tensor:
            store[act] = x
            return x
        return hook

    def intervention_hooks(self, ivs: Sequence[Intervention]) -> list[tuple[str, Callable]]:
        """(hook name, hook function) pairs that apply `ivs` (canonical names) in a backend run."""
        hooks: list[tuple[str, Callable]] = []
        for iv in ivs:
            act = iv.act
            assert isinstance(act, ActName)
            if act.kind == "logits":
                raise SiteError("logits cannot be intervened on", code="site_not_writable",
                                remedy="intervene on resid_post of the last layer, or edit the logits yourself")
            if act.kind == "result":
                hooks.extend(self._result_hooks(act, iv.fn))
                continue
            if act.kind == "features":
                hooks.extend(features.hooks(self, act, iv.fn))
                continue
            if self._needs_unfolded_norm(act):
                raise SiteError(f"{act} cannot be written on an unprocessed HookedTransformer",
                                code="site_not_writable", remedy="use resid_pre/resid_mid, or a processed model")

            def hook(x: Tensor, hook: Any = None, fn: InterventionFn = iv.fn) -> Tensor:
                return fn(x)
            hooks.append((self._hook(act), hook))
        return hooks

    def _result_hooks(self, act: ActName, fn: InterventionFn) -> list[tuple[str, Callable]]:
        """Writing a head's result: attn_out += sum_h (new_result_h - result_h); result from z."""
        stash: dict[str, Tensor] = {}
        W_O = self.weights.W_O(act.layer)

        def keep_z(z: Tensor, hook: Any = None) -> None:
            stash["z"] = z

        def edit_out(out: Tensor, hook: Any = None) -> Tensor:
            result = torch.einsum("bphd,hdm->bphm", stash.pop("z"), W_O.to(out.dtype))
            return out + (fn(result) - result).sum(dim=2)
        return [(self._hook(ActName("z", act.layer)), keep_z), (self._hook(ActName("attn_out", act.layer)), edit_out)]

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


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0, 32), 127] if chr(c) not in "\n\t"}
_CONTROL.update({ord("\n"): "\\n", ord("\t"): "\\t"})


def _printable(text: str) -> str:
    return text.translate(_CONTROL)


def adapt(model: Any) -> ModelAdapter:
    """The adapter for any accepted model (an adapter is returned as is)."""
    if isinstance(model, ModelAdapter):
        return model
    return ModelAdapter(model)
