"""TransformerLens backends: a TransformerBridge (transformer-lens 3.x and 4.x) and a HookedTransformer (< 4).

Both read and write through TransformerLens hook points: reads through `run_with_cache` (so a
CachedModel serves them), interventions through hooks (`run_with_hooks`). They differ in what the
numbers mean (structure.mode), in the names of the normalised inputs, and in how a run starts
part-way (partial.py): a HookedTransformer's blocks with a frozen TransformerLens key/value cache,
a bridge's blocks called one by one (bridge_start.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from ..errors import SiteError, UnsupportedModelError
from . import bridge_start
from .backend import Backend, BaseIntervention
from .hf_families import FAMILIES, PLAIN, Family, config_traits, traits_of
from .names import KINDS, ActName
from .structure import Structure
from .weights import Weights

_HOOKS = {
    "embed": "hook_embed", "pos_embed": "hook_pos_embed", "final_scale": "ln_final.hook_scale",
    "resid_pre": "blocks.{L}.hook_resid_pre", "resid_mid": "blocks.{L}.hook_resid_mid",
    "resid_post": "blocks.{L}.hook_resid_post", "attn_out": "blocks.{L}.hook_attn_out",
    "mlp_out": "blocks.{L}.hook_mlp_out", "ln1_scale": "blocks.{L}.ln1.hook_scale",
    "ln2_scale": "blocks.{L}.ln2.hook_scale", "q": "blocks.{L}.attn.hook_q",
    "k": "blocks.{L}.attn.hook_k", "v": "blocks.{L}.attn.hook_v", "z": "blocks.{L}.attn.hook_z",
    "attn_scores": "blocks.{L}.attn.hook_attn_scores", "pattern": "blocks.{L}.attn.hook_pattern",
    "mlp_pre": "blocks.{L}.mlp.hook_pre", "mlp_post": "blocks.{L}.mlp.hook_post",
    "rot_q": "blocks.{L}.attn.hook_rot_q", "rot_k": "blocks.{L}.attn.hook_rot_k",
    "ln1_post_scale": "blocks.{L}.ln1_post.hook_scale", "ln2_post_scale": "blocks.{L}.ln2_post.hook_scale",
}


def unmodelled_traits(tl: Any) -> list[str]:
    """What a TransformerLens model does that only a family row makes entoscope model (an architecture
    without a row is refused when it shows one): a norm gain of (1 + weight), post-norms, a scaled
    embedding, a final-logit soft cap."""
    cfg = tl.cfg
    blocks = getattr(tl, "blocks", None) or []
    out = []
    if getattr(cfg, "rmsnorm_uses_offset", False):
        out.append("RMSNorm with (1 + weight)")
    if getattr(cfg, "use_normalization_before_and_after", False) or (len(blocks) and hasattr(blocks[0], "ln1_post")):
        out.append("norms after attention and the MLP")
    embed = getattr(getattr(tl, "original_model", None), "get_input_embeddings", lambda: None)()
    if getattr(embed, "embed_scale", None) is not None:
        out.append("a scaled embedding")
    if float(getattr(cfg, "output_logits_soft_cap", -1.0) or -1.0) > 0:
        out.append("a final-logit soft cap")
    return out
# the families whose HookedTransformer key/value cache holds what the k and v hooks return
_KV_AS_HOOKED = ("GPT2LMHeadModel", "GPTNeoXForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
                 "MistralForCausalLM")


class _Stop(Exception):
    """Raised by a hook to end a forward once the last block a run reads is done (as TransformerLens's own
    stop_at_layer does): a patched run's final norm and unembedding then run on the answer rows only."""


class TLBackend(Backend):
    """What a TransformerBridge and a HookedTransformer share: hook points, cfg, W_* attributes."""

    norm_hook = "hook_out"

    def __init__(self, model: Any) -> None:
        self.tl = self.module = self.runner = model

    @property
    def tokenizer(self) -> Any:
        return self.tl.tokenizer

    @property
    def model_name(self) -> str:
        return str(getattr(self.tl.cfg, "model_name", None) or "")

    # --- structure
    def mode(self, norm_type: str, norm_offset: float = 0.0) -> tuple[str, bool]:
        """(structure.mode, norm_folded)."""
        raise NotImplementedError

    def tied(self) -> bool:
        return False

    def structure(self) -> Structure:
        cfg = self.tl.cfg
        missing = [f for f in ("n_layers", "n_heads", "d_model", "d_head", "d_vocab") if
                   getattr(cfg, f, None) in (None, -1)]
        if missing or not hasattr(self.tl, "blocks"):
            raise UnsupportedModelError(
                f"cannot describe this model: its config lacks {', '.join(missing) or 'blocks'}",
                remedy="entoscope supports decoder-only transformers with attention and MLP blocks "
                "(GPT-2, GPT-NeoX/Pythia, Llama, Qwen2, Mistral and what TransformerBridge maps alike)",
            )
        arch = getattr(cfg, "architecture", None) or getattr(cfg, "original_architecture", None) or "unknown"
        norm_type = str(getattr(cfg, "normalization_type", None))
        if norm_type not in ("LN", "LNPre", "RMS", "RMSPre"):
            raise UnsupportedModelError(
                f"cannot describe {arch}: its normalisation {norm_type!r} is not one entoscope knows",
                remedy="entoscope knows LayerNorm and RMSNorm models (pre-norm)")
        pos = str(getattr(cfg, "positional_embedding_type", "standard"))
        if pos not in ("standard", "rotary"):
            raise UnsupportedModelError(f"cannot describe {arch}: its positional embedding type is {pos!r}",
                                        remedy="entoscope studies attention decoders with learned ('standard') or "
                                        "rotary positions (GPT-2, GPT-NeoX, Llama, Qwen2, Mistral, Gemma, ...)")
        n_heads = int(cfg.n_heads)
        n_kv = getattr(cfg, "n_key_value_heads", None) or n_heads
        fam = self.family(str(arch))
        mode, folded = self.mode(norm_type, fam.norm_offset)
        hf_cfg = getattr(getattr(self.tl, "original_model", None), "config", None) or SimpleNamespace()
        return Structure(
            architecture=str(arch), n_layers=int(cfg.n_layers), n_heads=n_heads, n_kv_heads=int(n_kv),
            d_model=int(cfg.d_model), d_head=int(cfg.d_head), d_mlp=int(getattr(cfg, "d_mlp", 0) or 0),
            d_vocab=int(cfg.d_vocab), n_ctx=int(cfg.n_ctx),
            norm="rmsnorm" if norm_type.startswith("RMS") else "layernorm", norm_folded=folded,
            positional="rotary" if pos == "rotary" else "learned",
            parallel=bool(getattr(cfg, "parallel_attn_mlp", False)),
            gated_mlp=bool(getattr(cfg, "gated_mlp", False)), act_fn=str(getattr(cfg, "act_fn", "")),
            backend=self.name, mode=mode, tied_embeddings=self.tied(),  # type: ignore[arg-type]
            **config_traits(fam, hf_cfg, int(cfg.n_layers), int(cfg.d_model), int(cfg.d_head)),
        )

    def family(self, arch: str) -> Family:
        """The family row entoscope reads for this model: its own for a known architecture; for another, the
        plain row, once the model is seen to have none of what a row would have to say (else refused,
        `family_unsupported`, naming what entoscope does not model for it)."""
        fam = traits_of(arch)
        if fam is not None:
            return fam
        missing = unmodelled_traits(self.tl)
        if missing:
            raise UnsupportedModelError(
                f"{arch} is a decoder entoscope has no family row for, and it has {', '.join(missing)}, which "
                "entoscope must model to decompose it", code="family_unsupported",
                remedy=f"use a supported family (docs/families.md: {', '.join(FAMILIES)}), or add a row for "
                f"{arch} to models/hf_families.py")
        return PLAIN

    def weights(self, structure: Structure) -> Weights:
        return Weights(self.tl, structure)

    def hook(self, act: ActName) -> str:
        """The hook name of a base site."""
        if act.kind in ("attn_in", "mlp_in"):
            return f"blocks.{act.layer}.{'ln1' if act.kind == 'attn_in' else 'ln2'}.{self.norm_hook}"
        return _HOOKS[act.kind].format(L=act.layer)

    key = hook

    def activation_cache(self, acts: Mapping[ActName, Tensor]) -> Any:
        """TransformerLens's own ActivationCache of canonical activations, keyed by this model's hook names (a
        head's result, computed by entoscope, under TransformerLens's name for it: blocks.L.attn.hook_result)."""
        from transformer_lens import ActivationCache

        unhooked = [str(a) for a in acts if a.kind in ("logits", "features")]
        if unhooked:
            raise SiteError(f"{', '.join(unhooked)} has no TransformerLens hook to be keyed by", code="no_hook_name",
                            remedy="convert the other sites (to_activation_cache(names=[...])) and read these from "
                            "the trace itself")
        keys = {f"blocks.{a.layer}.attn.hook_result" if a.kind == "result" else self.hook(a): t for a, t in acts.items()}
        return ActivationCache(keys, self.tl)

    def check_sites(self, structure: Structure) -> None:
        names = set(self.tl.hook_dict.keys())
        needed = ["resid_pre", "resid_post", "attn_out", "mlp_out", "z", "pattern", "q", "k", "v"]
        lacking = [k for k in needed if self.hook(ActName(k, 0)) not in names]
        if lacking:
            raise UnsupportedModelError(
                f"this model does not expose the hooks entoscope needs for {', '.join(lacking)} "
                f"(looked for {', '.join(self.hook(ActName(k, 0)) for k in lacking)})",
                remedy="use an architecture TransformerBridge maps fully (GPT-2, NeoX, Llama, Qwen2, ...)",
            )

    def has_site(self, act: ActName) -> bool:
        return self.hook(act) in self.tl.hook_dict

    def sites(self, structure: Structure) -> list[ActName]:
        out = []
        for kind, k in KINDS.items():
            if kind in ("result", "logits", "features"):
                continue
            for L in range(structure.n_layers) if k.per_layer else [None]:
                act = ActName(kind, L)
                if self.has_site(act) and not self.computes_norm(act, structure):
                    out.append(act)
        order = {h: i for i, h in enumerate(self.tl.hook_dict)}
        return sorted(out, key=lambda a: order[self.hook(a)])

    def computes_norm(self, act: ActName, structure: Structure) -> bool:
        """Whether the normalised input `act` has no hook here, so the adapter computes it from the residual."""
        return False

    # --- runs
    def hooks_for(self, interventions: Sequence[BaseIntervention]) -> list[tuple[str, Callable]]:
        def wrap(fn: Callable) -> Callable:
            return lambda x, hook=None: fn(x)
        return [(self.hook(act), wrap(fn)) for act, fn in interventions]

    def run(self, tokens: Tensor, reads: Sequence[ActName], interventions: Sequence[BaseIntervention], *,
            logits: bool = True) -> tuple[Tensor | None, dict[ActName, Tensor]]:
        """With logits=False the forward ends after the last block it reads or writes."""
        raw: dict[ActName, Tensor] = {}
        hooks = self.hooks_for(interventions)
        for act in reads:
            hooks.append((self.hook(act), _saver(raw, act)))
        touched = [*reads, *(act for act, _ in interventions)]
        if not logits and all(a.layer is not None or a.kind in ("embed", "pos_embed") for a in touched):
            hooks.append((f"blocks.{max((a.layer for a in touched if a.layer is not None), default=0)}"
                          ".hook_resid_post", _stop))
        try:
            out = self.tl.run_with_hooks(tokens, fwd_hooks=hooks, return_type="logits" if logits else None)
        except _Stop:
            out = None
        return out if logits else None, raw

    def final_residual(self, tokens: Tensor, interventions: Sequence[BaseIntervention]) -> Tensor:
        final = ActName("resid_post", int(self.tl.cfg.n_layers) - 1)
        return self.run(tokens, [final], interventions, logits=False)[1][final]

    def final_norm(self, x: Tensor) -> Tensor:
        return self.tl.ln_final(x[:, None])[:, 0] if x.dim() == 2 else self.tl.ln_final(x)

    @property
    def logit_softcap(self) -> float:  # type: ignore[override]
        return float(getattr(self.tl.cfg, "output_logits_soft_cap", -1.0) or -1.0)

    def attention_scale(self, structure: Structure) -> float:
        scale = float(getattr(self.tl.cfg, "attn_scale", -1.0) or -1.0)
        if not bool(getattr(self.tl.cfg, "use_attn_scale", True)):
            return 1.0
        return scale if scale > 0 else structure.d_head ** 0.5

    # --- runs that start part-way
    def prefix_reads(self, layers: Sequence[int], structure: Structure) -> set[ActName]:
        """What a base run must read besides resid_pre.L so that runs can start at positions."""
        return set()

    def record_past(self, acts: dict[ActName, Tensor], layer: int, structure: Structure) -> None:
        raise NotImplementedError

    def walk(self, start: Any, interventions: Sequence[BaseIntervention], structure: Structure) -> Tensor:
        raise NotImplementedError


def _mid_through_attn_out(layer: int, fn: Callable) -> list[tuple[str, Callable]]:
    """Hooks that write `fn` to layer's resid_mid through its attention output (see BridgeBackend.hooks_for)."""
    kept: dict[str, Tensor] = {}

    def keep_pre(x: Tensor, hook: Any = None) -> None:
        kept["pre"] = x

    def edit_out(out: Tensor, hook: Any = None) -> Tensor:
        mid = kept.pop("pre") + out
        return out + (fn(mid) - mid)

    return [(f"blocks.{layer}.hook_resid_pre", keep_pre), (f"blocks.{layer}.hook_attn_out", edit_out)]


def _stop(x: Tensor, hook: Any = None) -> None:
    raise _Stop


def _saver(store: dict[ActName, Tensor], act: ActName) -> Callable:
    # Returning x matters: the bridge hands some hooks (q, k, v, z) a reshaped copy and only a
    # returned tensor flows on, so a stored-but-not-returned copy would be off the autograd path.
    def hook(x: Tensor, hook: Any = None) -> Tensor:
        store[act] = x
        return x
    return hook


class BridgeBackend(TLBackend):
    """A TransformerBridge: HuggingFace's weights (plain) or HookedTransformer-equivalent ones (compat)."""

    name = "bridge"

    @classmethod
    def accepts(cls, model: Any) -> bool:
        try:
            from transformer_lens.model_bridge import TransformerBridge
        except ImportError:  # pragma: no cover - every supported release has the bridge
            return False
        return isinstance(model, TransformerBridge)

    def mode(self, norm_type: str, norm_offset: float = 0.0) -> tuple[str, bool]:
        compat = bool(getattr(self.tl, "compatibility_mode", False))
        return ("compat" if compat else "plain"), compat and self._norms_are_identity(norm_offset)

    def _norms_are_identity(self, offset: float = 0.0) -> bool:
        """Compatibility mode folds each norm's weight into the next matrices and leaves gain 1, bias 0 (a
        stored weight of 1 - offset: Gemma's (1 + weight) norms keep 0). Post-norms are not folded."""
        mods = [self.tl.ln_final] + [getattr(b, ln) for b in self.tl.blocks for ln in ("ln1", "ln2")]
        for mod in mods:
            for name, p in mod.named_parameters():
                target = 1.0 - offset if name.endswith("weight") or name.endswith("w") else 0.0
                if not torch.all(p == target):
                    return False
        return True

    def tied(self) -> bool:
        hf_cfg = getattr(getattr(self.tl, "original_model", None), "config", None)
        return bool(getattr(hf_cfg, "tie_word_embeddings", False))

    def keeps_last_logits(self) -> bool:
        forward = getattr(getattr(self.tl, "original_model", None), "forward", None)
        try:
            return "logits_to_keep" in inspect.signature(forward).parameters
        except (TypeError, ValueError):
            return False

    def _support(self, structure: Structure) -> bridge_start.Support:
        return bridge_start.support(self.tl, structure.architecture, structure.d_vocab, structure.mode)

    def prefix_support(self, structure: Structure) -> str:
        return self._support(structure).level

    def prefix_note(self, structure: Structure) -> str:
        return self._support(structure).note

    def start_paths(self) -> dict[str, str]:
        return {"positions": "the bridge's blocks called from that layer on, with a frozen key/value prefix",
                "layers": "the bridge's blocks called from that layer on"}

    def hooks_for(self, interventions: Sequence[BaseIntervention]) -> list[tuple[str, Callable]]:
        """A bridge's hook_resid_mid is the second norm's input: a write there would change what the MLP
        reads but not the residual the MLP's output is added to. So a resid_mid write is made where the
        residual is formed: attn_out' = attn_out + (f(mid) - mid), mid = resid_pre + attn_out (both as
        the run has them after every other write)."""
        plain = [(act, fn) for act, fn in interventions if act.kind != "resid_mid"]
        hooks = super().hooks_for(plain)
        for act, fn in interventions:
            if act.kind == "resid_mid":
                hooks += _mid_through_attn_out(act.layer, fn)
        return hooks

    def written_through(self, act: ActName) -> ActName:
        return ActName("attn_out", act.layer) if act.kind == "resid_mid" else act

    def record_past(self, acts: dict[ActName, Tensor], layer: int, structure: Structure) -> None:
        with torch.no_grad():
            keys, values = bridge_start.record(self.tl, structure.architecture, acts[ActName("resid_pre", layer)],
                                               layer)
        for L in range(layer, structure.n_layers):  # the attention's [B, heads, T, d_head], seen as [B, T, heads, d_head]
            acts[ActName("past_k", L)], acts[ActName("past_v", L)] = keys[L].transpose(1, 2), values[L].transpose(1, 2)

    def walk(self, start: Any, interventions: Sequence[BaseIntervention], structure: Structure) -> Tensor:
        past = None
        if start.position > 0:
            layers = range(start.layer, structure.n_layers)
            past = bridge_start.FrozenPrefix({L: k.transpose(1, 2) for L, k in zip(layers, start.keys)},
                                             {L: v.transpose(1, 2) for L, v in zip(layers, start.values)})
        return bridge_start.walk(self.tl, structure.architecture, start.resid, start.layer, start.position,
                                 past=past, hooks=self.hooks_for(interventions), joins=start.joins)


class HookedBackend(TLBackend):
    """A HookedTransformer (transformer-lens < 4): TransformerLens's processed model, or an unprocessed one."""

    name = "hooked"
    norm_hook = "hook_normalized"

    @classmethod
    def accepts(cls, model: Any) -> bool:
        try:
            from transformer_lens import HookedTransformer
        except ImportError:  # transformer-lens 4.x has no HookedTransformer
            return False
        return isinstance(model, HookedTransformer)

    def family(self, arch: str) -> Family:
        """A HookedTransformer of a family with a row of its own is refused: entoscope builds and reads the
        plain families only (TransformerLens 3's Gemma support is not mapped here)."""
        fam = traits_of(arch)
        if (fam is not None and fam.traits) or unmodelled_traits(self.tl):
            raise UnsupportedModelError(
                f"entoscope does not read a HookedTransformer of {arch} (its "
                f"{', '.join(fam.traits if fam is not None else unmodelled_traits(self.tl))} are not mapped "
                "on this backend)", code="family_unsupported",
                remedy="load it with --backend bridge (a TransformerBridge) or --backend nnsight")
        return fam or PLAIN

    def mode(self, norm_type: str, norm_offset: float = 0.0) -> tuple[str, bool]:
        folded = norm_type.endswith("Pre")
        return ("processed" if folded else "unprocessed"), folded

    def computes_norm(self, act: ActName, structure: Structure) -> bool:
        return act.kind in ("attn_in", "mlp_in") and not structure.norm_folded

    def prefix_support(self, structure: Structure) -> str:
        cfg = self.tl.cfg
        if str(getattr(cfg, "positional_embedding_type", "standard")) not in ("standard", "rotary", "alibi"):
            return "none"  # shortformer: positions are re-added at every layer from outside the residual
        if getattr(cfg, "attention_dir", "causal") != "causal":
            return "none"
        quirks = (getattr(cfg, "use_qk_norm", False), getattr(cfg, "clip_qkv", None) is not None,
                  getattr(cfg, "use_attention_sinks", False), getattr(cfg, "use_logn_attn", False),
                  getattr(cfg, "use_split_qkv_input", False), getattr(cfg, "use_attn_in", False))
        arch = str(getattr(cfg, "original_architecture", ""))
        if any(quirks) or arch not in _KV_AS_HOOKED:
            return "layers"
        return "positions"

    def start_paths(self) -> dict[str, str]:
        return {"positions": "the HookedTransformer's blocks called from that layer on, with a frozen key/value cache",
                "layers": "the HookedTransformer's blocks called from that layer on"}

    def prefix_reads(self, layers: Sequence[int], structure: Structure) -> set[ActName]:
        reads: set[ActName] = set()
        for L in range(min(layers), structure.n_layers):  # its cache holds what its k and v hooks return
            reads |= {ActName("k", L), ActName("v", L)}
        return reads

    def record_past(self, acts: dict[ActName, Tensor], layer: int, structure: Structure) -> None:
        for L in range(layer, structure.n_layers):
            acts[ActName("past_k", L)], acts[ActName("past_v", L)] = acts[ActName("k", L)], acts[ActName("v", L)]

    def walk(self, start: Any, interventions: Sequence[BaseIntervention], structure: Structure) -> Tensor:
        """The blocks start.layer.. in order (what its forward does with start_at_layer), rows joining where
        `start.joins` says, the unchanged positions in a frozen key/value cache entry per block."""
        h = start.resid
        with self.tl.hooks(fwd_hooks=self.hooks_for(interventions)):
            for i, block in enumerate(self.tl.blocks[start.layer:]):
                if start.layer + i in start.joins:
                    h = torch.cat([h, start.joins[start.layer + i].to(h.dtype)])
                entry = _kv_entry(start.keys[i], start.values[i]) if start.position > 0 else None
                h = block(h, past_kv_cache_entry=entry)
        return h


def _kv_entry(keys: Tensor, values: Tensor) -> Any:
    try:
        from transformer_lens.cache.key_value_cache_entry import TransformerLensKeyValueCacheEntry
    except ImportError:  # older releases
        from transformer_lens.past_key_value_caching import (  # type: ignore[no-redef]
            HookedTransformerKeyValueCacheEntry as TransformerLensKeyValueCacheEntry)
    return TransformerLensKeyValueCacheEntry(keys, values, frozen=True)
