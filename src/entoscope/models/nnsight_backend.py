"""nnsight backend: an `nnsight.LanguageModel` (nnsight 0.8) read and written through nnsight's own tracing.

Every run is one `model.trace(tokens)`; inside it the sites are visited in the order the forward
reaches them (nnsight requires that order) and read or replaced through the envoys' `.input` /
`.output`. Nothing is converted: the numbers are HuggingFace's own, as on a plain TransformerBridge.
`use_remote(model)` (models/nnsight_remote.py) sends every trace to NDIF through nnsight's own client,
each wait on the host bounded by a timeout and every failure one refusal with a code; entoscope tests
that path against loopback servers (refusing, 401, silent) and nnsight's local dry run, not NDIF.

Where each canonical site is (module paths per family in hf_families.py):

  embed / pos_embed     the embedding modules' outputs
  resid_pre.L           block L's input;  resid_post.L: its output
  attn_in.L, mlp_in.L   the two norms' outputs; ln1_scale / ln2_scale / final_scale: computed from the
                        norms' inputs (sqrt(var + eps)); written by re-applying the norm with that scale
  q, k, v               the projections' outputs (before rotary), split into heads; under fused
                        projections (GPT-2 c_attn, NeoX query_key_value) split and joined again
  z                     the output projection's input, split into heads
  attn_out, mlp_out     the attention's (first) output and the MLP's output
  resid_mid.L           the second norm's input (sequential blocks). Written as what it is, the residual
                        between attention and MLP: attn_out becomes new - resid_pre, so the MLP and the
                        skip connection both see the new value (as in a HookedTransformer)
  mlp_pre, mlp_post     the MLP's input projection's output (the gate's under a gated MLP), the output
                        projection's input
  logits                the unembedding's output

Per-head quantities the module tree does not expose (rot_q, rot_k, attn_scores, pattern) are computed
as the bridge computes them on HuggingFace weights: rotary from the (cos, sin) the attention module is
given, scores = q.k * the module's own `scaling` with the causal mask, pattern = softmax in float32.
When one of them is written (or read with gradients) entoscope computes the attention itself from
there, z = pattern @ v, and hands that z to the output projection. A load-time check compares the
computed pattern with the model's own z; a model that fails it keeps every other site, and these four
are refused (`nnsight_heads_unavailable`).

Runs that start part-way are not offered (prefix support "none"): every patched run is a full forward.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from ..errors import SiteError
from .backend import Backend, BaseIntervention
from .fingerprint import weights_stamp
from .hf_families import HFWeights, family_of, get, structure_of, unembed_path
from .names import KINDS, ActName, parse_name
from .nnsight_remote import trace_kwargs, use_remote  # noqa: F401  (use_remote: the public spelling, here too)
from .structure import Structure
from .weights import Weights

HEAD_DERIVED = ("rot_q", "rot_k", "attn_scores", "pattern")
_LAYER_ORDER = ("resid_pre", "ln1_scale", "attn_in", "q", "k", "v", "rot_q", "rot_k", "attn_scores", "pattern",
                "z", "ln1_post_scale", "attn_out", "resid_mid", "ln2_scale", "mlp_in", "mlp_pre", "mlp_post",
                "ln2_post_scale", "mlp_out", "resid_post")


def _is_nnsight(model: Any) -> bool:
    if "nnsight" not in sys.modules:  # no nnsight model exists before nnsight is imported (a second of imports)
        return False
    try:
        from nnsight.intervention.envoy import Envoy
    except ImportError:  # nnsight is an optional extra
        return False
    return isinstance(model, Envoy) and isinstance(model.__dict__.get("_module"), torch.nn.Module)


@dataclass
class _Plan:
    """What one run does at each site: interventions (in order) and which values it keeps."""

    writes: dict[ActName, list] = field(default_factory=dict)
    reads: set[ActName] = field(default_factory=set)
    grad: bool = False

    def touched(self, act: ActName) -> bool:
        return act in self.writes or act in self.reads

    def apply(self, act: ActName, x: Tensor, store: dict[ActName, Tensor]) -> tuple[Tensor, bool]:
        """(value after the interventions at `act`, whether any changed it); keeps it if read."""
        changed = False
        for fn in self.writes.get(act, ()):
            new = fn(x)
            if new is not None and new is not x:
                x, changed = new, True
        if act in self.reads:
            store[act] = x
        return x, changed


class NNsightBackend(Backend):
    """An nnsight LanguageModel (any `nnsight.NNsight` around a HuggingFace causal LM of a known family)."""

    name = "nnsight"

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return _is_nnsight(model)

    def __init__(self, model: Any) -> None:
        self.lm = model
        self.module = model.__dict__["_module"]
        self.fam = family_of(self.module)
        self.unembed = unembed_path(self.module)
        self.runner = NNsightRunner(self)
        self.s: Structure | None = None
        self._heads_refused: str | None = None

    @property
    def tokenizer(self) -> Any:
        return self.lm.tokenizer

    @property
    def model_name(self) -> str:
        return str(self.module.__dict__.get("_entoscope_name") or getattr(self.module.config, "name_or_path", "")
                   or "")

    def structure(self) -> Structure:
        self.s = structure_of(self.module, self.name)
        return self.s

    def weights(self, structure: Structure) -> Weights:
        return HFWeights(self.module, structure)

    def key(self, act: ActName) -> str:
        return str(act)

    def keeps_last_logits(self) -> bool:
        import inspect

        try:
            return "logits_to_keep" in inspect.signature(self.module.forward).parameters
        except (TypeError, ValueError):
            return False

    def has_site(self, act: ActName) -> bool:
        s = self.s
        assert s is not None
        if act.kind in ("rot_q", "rot_k"):
            return s.positional == "rotary"
        if act.kind == "pos_embed":
            return s.positional == "learned"
        if act.kind == "resid_mid":
            return not s.parallel
        if act.kind in ("ln1_post_scale", "ln2_post_scale"):
            return s.post_norms
        return act.kind in KINDS and act.kind not in ("result", "logits", "features")

    def sites(self, structure: Structure) -> list[ActName]:
        out = [ActName("embed")] + ([ActName("pos_embed")] if structure.positional == "learned" else [])
        for L in range(structure.n_layers):
            out += [ActName(k, L) for k in _LAYER_ORDER if self.has_site(ActName(k, L))]
        return out + [ActName("final_scale")]

    def written_through(self, act: ActName) -> ActName:
        return ActName("attn_out", act.layer) if act.kind == "resid_mid" else act  # attn_out = new - resid_pre

    def check_servable(self, act: ActName) -> None:
        if act.kind in HEAD_DERIVED and self._heads_refused:
            raise SiteError(f"{act}: this nnsight model's attention could not be reproduced from its q, k and v "
                            f"({self._heads_refused}), so its rotated q/k, scores and pattern are not served",
                            code="nnsight_heads_unavailable",
                            remedy="use q, k, v, z or attn_out here, or wrap the model in a TransformerBridge")

    def check_sites(self, structure: Structure) -> None:
        """A 4-token forward: z recomputed from the pattern entoscope derives must be the model's own z.
        Its verdict is kept on the module once per weights version (`weights_stamp`), as the other one-time
        checks are (guards.py), and per remote setting (`use_remote`): adapting the same model again runs no
        forward, and the first adapt after `use_remote` runs it remotely, so a host that refuses is found there."""
        remote = (self.lm.__dict__.get("_entoscope_remote", False),
                  repr(sorted((self.lm.__dict__.get("_entoscope_remote_options") or {}).items())))
        stamp = (weights_stamp(self.module), remote)
        known = self.module.__dict__.get("_entoscope_heads_check")
        if known is not None and known[0] == stamp:
            self._heads_refused = known[1]
            return
        self._heads_refused = self._pattern_gap(structure)
        self.module._entoscope_heads_check = (stamp, self._heads_refused)

    def _pattern_gap(self, structure: Structure) -> str | None:
        """Why rotated q/k, scores and pattern cannot be served (the first layer where pattern @ v is not z)."""
        n = min(4, structure.n_ctx)
        tokens = torch.arange(1, n + 1, device=self.device).remainder(structure.d_vocab)[None]
        reads = [ActName(k, L) for L in range(structure.n_layers) for k in ("pattern", "v", "z")]
        with torch.no_grad():
            _, acts = self.run(tokens, reads, [], logits=False)
        g = structure.group_size
        for L in range(structure.n_layers):
            v = acts[ActName("v", L)].repeat_interleave(g, dim=2)
            mine = torch.einsum("bhqk,bkhd->bqhd", acts[ActName("pattern", L)].to(v.dtype), v)
            z = acts[ActName("z", L)]
            gap = float((mine.double() - z.double()).abs().max())
            if not gap <= 1e-3 * (1 + float(z.abs().max())):
                return f"layer {L}: pattern @ v is {gap:.3g} away from the model's z"
        return None

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    # ------------------------------------------------------------------ runs
    def run(self, tokens: Tensor, reads: Sequence[ActName], interventions: Sequence[BaseIntervention], *,
            logits: bool = True, logits_to_keep: int | None = None) -> tuple[Tensor | None, dict[ActName, Tensor]]:
        plan = _Plan(reads=set(reads), grad=torch.is_grad_enabled())
        for act, fn in interventions:
            plan.writes.setdefault(act, []).append(fn)
        touched = set(plan.reads) | set(plan.writes)
        last = max((a.layer for a in touched if a.layer is not None), default=-1)
        if any(a.kind == "final_scale" for a in touched):
            last = self.s.n_layers  # type: ignore[union-attr]
        store: dict[ActName, Tensor] = {}
        kwargs: dict[str, Any] = {}
        if logits_to_keep is not None:
            kwargs["logits_to_keep"] = logits_to_keep
        with self.lm.trace(tokens, **trace_kwargs(self.lm), **kwargs) as tracer:
            with torch.set_grad_enabled(plan.grad):
                self._visit_model(plan, store, last, tokens.shape[0])
                if logits:
                    store[ActName("logits")] = get(self.lm, self.unembed).output
                else:
                    tracer.stop()
        out_logits = store.pop(ActName("logits"), None)
        cap = self.logit_softcap
        if out_logits is not None and cap > 0:  # HuggingFace caps after the unembedding module (Gemma 2)
            out_logits = cap * torch.tanh(out_logits / cap)
        return out_logits, store

    @property
    def logit_softcap(self) -> float:  # type: ignore[override]
        return float((self.s.final_softcap if self.s is not None else None) or -1.0)

    def final_residual(self, tokens: Tensor, interventions: Sequence[BaseIntervention]) -> Tensor:
        final = ActName("resid_post", self.s.n_layers - 1)  # type: ignore[union-attr]
        return self.run(tokens, [final], interventions, logits=False)[1][final]

    def final_norm(self, x: Tensor) -> Tensor:
        return get(self.module, self.fam.final_norm)(x)

    def attention_scale(self, structure: Structure) -> float:
        return 1.0 / float(self._attn(self.module, 0).scaling)

    def _attn(self, root: Any, layer: int) -> Any:
        return get(get(root, self.fam.blocks)[layer], self.fam.attn)

    # ------------------------------------------------------------------ the visit, in forward order
    def _visit_model(self, plan: _Plan, store: dict[ActName, Tensor], last: int, batch: int) -> None:
        lm, fam, s = self.lm, self.fam, self.s
        assert s is not None
        self._site(plan, store, get(lm, fam.embed), "output", ActName("embed"))
        if fam.pos_embed is not None:  # one row for the batch: seen per row, written back as given
            per_row = (lambda o: o.expand(batch, *o.shape[1:]), lambda o, x: x)
            self._site(plan, store, get(lm, fam.pos_embed), "output", ActName("pos_embed"), view=per_row)
        blocks = get(lm, fam.blocks)
        for L in range(min(last + 1, s.n_layers)):
            self._visit_block(plan, store, blocks[L], L)
        if last >= s.n_layers:
            self._norm_scale(plan, store, get(lm, fam.final_norm), ActName("final_scale"), None, "final")

    def _site(self, plan: _Plan, store: dict[ActName, Tensor], env: Any, attr: str, act: ActName,
              view: Any = None) -> Tensor | None:
        """Read/replace one module value: `view` = (to canonical, back to the module's layout) when the
        canonical layout differs (heads split, tuple outputs). Returns the canonical value if visited."""
        if not plan.touched(act):
            return None
        raw = getattr(env, attr)
        x = view[0](raw) if view else raw
        new, changed = plan.apply(act, x, store)
        if changed or (view and plan.grad and act in plan.reads):  # a read view must be what flows on
            setattr(env, attr, view[1](raw, new) if view else new)
        return new

    def _norm_scale(self, plan: _Plan, store: dict[ActName, Tensor], env: Any, scale_act: ActName,
                    out_act: ActName | None, which: str) -> None:
        """A norm's scale (computed from its input) and its output."""
        if plan.touched(scale_act):
            norm = self._norm(which, scale_act.layer)
            x_in = env.input
            scale, changed = plan.apply(scale_act, norm.scale(x_in), store)
            if changed or (plan.grad and scale_act in plan.reads):
                env.output = norm(x_in, scale=scale).to(x_in.dtype)
        if out_act is not None:
            self._site(plan, store, env, "output", out_act)

    def _norm(self, which: str, layer: int | None) -> Any:
        w = HFWeights(self.module, self.s)  # type: ignore[arg-type]
        if which in ("attn", "mlp"):  # the post-norms
            return w.post_norm(layer, which)  # type: ignore[arg-type]
        return w.final_norm if which == "final" else w.norm(layer, which)  # type: ignore[arg-type]

    def _output_site(self, plan: _Plan, store: dict[ActName, Tensor], block: Any, L: int, which: str) -> Any:
        """The envoy whose output is attn_out / mlp_out (what is added to the residual): the post-norm on a
        post-norm family (its scale read or written first), else the attention / MLP module itself."""
        fam = self.fam
        path = (fam.post_ln1 if which == "attn" else fam.post_ln2) if self.s.post_norms else None  # type: ignore[union-attr]
        if path is None:
            return get(block, fam.attn if which == "attn" else fam.mlp)
        env = get(block, path)
        kind = "ln1_post_scale" if which == "attn" else "ln2_post_scale"
        self._norm_scale(plan, store, env, ActName(kind, L), None, which)
        return env

    def _visit_block(self, plan: _Plan, store: dict[ActName, Tensor], block: Any, L: int) -> None:
        fam, s = self.fam, self.s
        assert s is not None
        act = lambda kind: ActName(kind, L)  # noqa: E731
        mid_written = act("resid_mid") in plan.writes
        resid = self._site(plan, store, block, "input", act("resid_pre")) if plan.touched(act("resid_pre")) else None
        if mid_written and resid is None:
            resid = block.input
        self._norm_scale(plan, store, get(block, fam.ln1), act("ln1_scale"), act("attn_in"), "ln1")
        self._visit_attention(plan, store, block, L)
        out = act("attn_out")
        out_env = self._output_site(plan, store, block, L, "attn")
        if plan.touched(out) or mid_written:
            raw = out_env.output
            tupled = isinstance(raw, tuple)  # the attention module's (output, weights); a post-norm's tensor
            x, changed = plan.apply(out, raw[0] if tupled else raw, store)
            if mid_written:  # the residual between attention and MLP, written as what attention adds
                new_mid, mid_changed = plan.apply(act("resid_mid"), resid + x, {})
                if mid_changed:
                    x, changed = new_mid - resid, True
            if changed:
                out_env.output = (x, *raw[1:]) if tupled else x
        ln2 = get(block, fam.ln2)
        if act("resid_mid") in plan.reads:
            store[act("resid_mid")] = ln2.input
        self._norm_scale(plan, store, ln2, act("ln2_scale"), act("mlp_in"), "ln2")
        self._site(plan, store, get(block, fam.mlp_in), "output", act("mlp_pre"))
        self._site(plan, store, get(block, fam.mlp_out_proj), "input", act("mlp_post"))
        self._site(plan, store, self._output_site(plan, store, block, L, "mlp"), "output", act("mlp_out"))
        first = (lambda o: o[0] if isinstance(o, tuple) else o, lambda o, x: (x, *o[1:]) if isinstance(o, tuple) else x)
        self._site(plan, store, block, "output", act("resid_post"), view=first)

    def _visit_attention(self, plan: _Plan, store: dict[ActName, Tensor], block: Any, L: int) -> None:
        fam, s = self.fam, self.s
        assert s is not None
        act = lambda kind: ActName(kind, L)  # noqa: E731
        derived = [act(k) for k in HEAD_DERIVED if plan.touched(act(k))]
        take_over = any(a in plan.writes or plan.grad for a in derived)
        needs = {act(k) for k in "qkv" if plan.touched(act(k))}
        if derived:
            needs |= {act("q"), act("k")} | ({act("v")} if take_over else set())
        if not needs and not plan.touched(act("z")):
            return
        attn = get(block, fam.attn)
        rotary = None
        if derived and s.positional == "rotary":
            args, kwargs = attn.inputs
            rotary = kwargs.get("position_embeddings")
        seen: dict[str, Tensor] = {}
        n = {"q": s.n_heads, "k": s.n_kv_heads, "v": s.n_kv_heads}
        if fam.qkv_layout == "separate":
            for i, w in enumerate("qkv"):
                if act(w) in needs:
                    env = get(block, fam.qkv[i])
                    view = (lambda o, m=n[w]: o.unflatten(-1, (m, s.d_head)), lambda o, x: x.flatten(-2))
                    raw = env.output
                    x = view[0](raw)
                    new, changed = plan.apply(act(w), x, store)
                    if changed or (plan.grad and (act(w) in plan.reads or take_over)):
                        env.output = view[1](raw, new)
                    seen[w] = new
        elif needs:
            env = get(block, fam.qkv)
            raw = env.output
            parts = self._split_qkv(raw)
            changed_any = False
            for w in "qkv":
                parts[w], changed = plan.apply(act(w), parts[w], store)
                changed_any |= changed
                seen[w] = parts[w]
            if changed_any or (plan.grad and (take_over or any(act(w) in plan.reads for w in "qkv"))):
                env.output = self._join_qkv(parts)
        z_env = get(block, fam.attn_out_proj)
        if not derived and not plan.touched(act("z")):
            return
        z_raw = z_env.input
        z = z_raw.unflatten(-1, (s.n_heads, s.d_head))
        if derived:
            pattern, v = self._attend(plan, store, L, seen, rotary, float(get(block, fam.attn).scaling))
            if take_over:
                z = torch.einsum("bhqk,bkhd->bqhd", pattern.to(v.dtype), v)
        z, changed = plan.apply(act("z"), z, store)
        if changed or take_over or (plan.grad and act("z") in plan.reads):
            z_env.input = z.flatten(-2)

    def _attend(self, plan: _Plan, store: dict[ActName, Tensor], L: int, seen: dict[str, Tensor], rotary: Any,
                scaling: float) -> tuple[Tensor, Tensor]:
        """rot_q, rot_k, scores and pattern from this run's q and k (each written where asked); (pattern, v per
        query head)."""
        s = self.s
        assert s is not None
        q, k = seen["q"], seen["k"]
        if s.qk_norm:  # Gemma 3: per-head norms of q and k, before rotary (the q and k sites are before them)
            w = HFWeights(self.module, s)
            q, k = w.qk_norm(L, "q")(q).to(q.dtype), w.qk_norm(L, "k")(k).to(k.dtype)
        if rotary is not None:
            cos, sin = rotary
            q, _ = plan.apply(ActName("rot_q", L), _rotate(q, cos, sin), store)
            k, _ = plan.apply(ActName("rot_k", L), _rotate(k, cos, sin), store)
        g = s.group_size
        k = k.repeat_interleave(g, dim=2)
        T_q, T_k = q.shape[1], k.shape[1]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scaling
        if s.attn_softcap:  # Gemma 2: c * tanh(scores / c), before the mask (as HuggingFace's eager attention)
            scores = s.attn_softcap * torch.tanh(scores / s.attn_softcap)
        future = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).triu(T_k - T_q + 1)
        if L in s.sliding_layers:  # keys more than sliding_window - 1 positions back are not seen
            future |= torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).tril(T_k - T_q - s.sliding_window)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)  # HuggingFace's mask value
        scores, _ = plan.apply(ActName("attn_scores", L), scores, store)
        pattern = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        pattern, _ = plan.apply(ActName("pattern", L), pattern, store)
        v = seen["v"].repeat_interleave(g, dim=2) if "v" in seen else None
        return pattern, v  # type: ignore[return-value]

    def _split_qkv(self, raw: Tensor) -> dict[str, Tensor]:
        s = self.s
        assert s is not None
        if self.fam.qkv_layout == "split":
            q, k, v = raw.split(s.n_heads * s.d_head, dim=-1)
            return {w: t.unflatten(-1, (s.n_heads, s.d_head)) for w, t in zip("qkv", (q, k, v))}
        q, k, v = raw.unflatten(-1, (s.n_heads, 3 * s.d_head)).chunk(3, dim=-1)  # per head [q k v]
        return {"q": q, "k": k, "v": v}

    def _join_qkv(self, parts: dict[str, Tensor]) -> Tensor:
        if self.fam.qkv_layout == "split":
            return torch.cat([parts[w].flatten(-2) for w in "qkv"], dim=-1)
        return torch.cat([parts[w] for w in "qkv"], dim=-1).flatten(-2)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary on the first cos.shape[-1] dimensions of x [B, T, heads, d_head] (HuggingFace's half-split
    convention: pairs (i, i + d/2)); cos, sin [B or 1, T, rotary_dim]."""
    d = cos.shape[-1]
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    rot, rest = x[..., :d], x[..., d:]
    half = torch.cat([-rot[..., d // 2:], rot[..., : d // 2]], dim=-1)
    return torch.cat([rot * cos + half * sin, rest], dim=-1)


def _parse(name: str) -> ActName:
    kind, _, layer = name.partition(".")
    return ActName(kind, int(layer)) if kind in ("rot_q", "rot_k") else parse_name(name)


class NNsightRunner:
    """What cached reads call on an nnsight model: `run_with_cache` over canonical site names, as
    TransformerLens's (so `CachedModel` keeps them on disk the same way). `hook_dict` lists the names."""

    _entoscope_backend = "nnsight"

    def __init__(self, backend: NNsightBackend) -> None:
        self.backend = backend

    @property
    def cfg(self) -> Any:
        s = self.backend.s or self.backend.structure()
        return SimpleNamespace(model_name=self.backend.model_name or s.architecture)

    @property
    def hook_dict(self) -> dict[str, str]:
        if self.backend.s is None:
            self.backend.structure()
        return {str(a): str(a) for a in self.backend.sites(self.backend.s)}  # type: ignore[arg-type]

    @property
    def module(self) -> Any:
        return self.backend.module

    def run_with_cache(self, tokens: Tensor, names_filter: Sequence[str] = (), return_type: str = "logits",
                       stop_at_layer: int | None = None, logits_to_keep: int | None = None,
                       return_cache_object: bool = False) -> tuple[Tensor | None, dict[str, Tensor]]:
        if self.backend.s is None:
            self.backend.structure()
        names = [names_filter] if isinstance(names_filter, str) else list(names_filter)
        acts = [_parse(n) for n in names]
        logits, raw = self.backend.run(tokens, acts, [], logits=stop_at_layer is None and return_type is not None,
                                       logits_to_keep=logits_to_keep)
        return logits, {str(a): t for a, t in raw.items()}
