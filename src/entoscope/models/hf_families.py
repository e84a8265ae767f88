"""HuggingFace model families as data: where each piece sits in the module tree, the structure record
read from the config, and the weights in entoscope's layout read from the modules.

Used by backends that run a HuggingFace model as it is (nnsight): nothing is converted or folded, so
the numbers are HuggingFace's own, as on a plain TransformerBridge. A family missing here is refused
at load time (`hf_family_unknown`), naming the families that are known.

Weight layouts (HuggingFace -> entoscope, see weights.py for the target shapes):
  GPT-2   Conv1D stores [in, out]; c_attn's output is q | k | v, each [d_model] wide, heads contiguous.
  NeoX    nn.Linear stores [out, in]; query_key_value's output is per head [q_h | k_h | v_h].
  Llama   separate q/k/v projections [heads * d_head, d_model]; k and v have n_kv_heads heads.
  Gemma   Llama's layout; a norm before AND after attention and the MLP (HuggingFace's
          post_attention_layernorm is the POST-attention norm there, pre_feedforward_layernorm the pre-MLP
          one), q/k norms per head before rotary, RMSNorm computing x / rms * (1 + weight), embeddings
          scaled by sqrt(d_model) inside the embedding module.

What a family does differently (norm form, embedding scale, post-norms, q/k norms, soft caps, sliding
windows, the attention scale) is DATA here, in the `Family` row: backends and operations read the
structure record and `Weights`, which are made from it, and never branch on an architecture's name.
The TransformerBridge reads the same rows (`traits_of`) for what TransformerLens does not say itself
(the norm form entoscope must apply, post-norms, the embedding scale); docs/families.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import UnsupportedModelError
from .structure import Structure
from .weights import Norm, Weights


@dataclass(frozen=True)
class Family:
    """Module paths of one family (relative to the causal LM; block paths relative to a block)."""

    blocks: str
    embed: str
    pos_embed: str | None
    final_norm: str
    ln1: str
    ln2: str
    attn: str
    mlp: str
    qkv: str | tuple[str, str, str]  # one fused projection, or (q, k, v)
    qkv_layout: str                  # "split" (GPT-2: q|k|v), "per_head" (NeoX: [q_h k_h v_h] per head), "separate"
    attn_out_proj: str               # its input is z (heads merged)
    mlp_in: str                      # its output is mlp_pre (the gate's, for gated MLPs)
    mlp_out_proj: str                # its input is mlp_post
    mlp_up: str | None = None        # gated MLPs: the up projection (W_in)
    conv1d: bool = False             # weights stored [in, out]
    # --- what the family does differently (defaults: a plain pre-norm decoder)
    norm_offset: float = 0.0         # every RMSNorm multiplies by (norm_offset + weight): Gemma's (1 + weight)
    embed_scale: str | None = None   # "sqrt_d_model": the embedding module multiplies W_E[token] by sqrt(d_model)
    post_ln1: str | None = None      # the norm applied to the attention's output before it is added (Gemma 2/3)
    post_ln2: str | None = None      # the norm applied to the MLP's output before it is added
    q_norm: str | None = None        # per-head norms of q and k before rotary (relative to a block)
    k_norm: str | None = None
    attn_scale_key: str | None = None    # config key whose value**-0.5 scales q.k (Gemma: query_pre_attn_scalar)
    attn_softcap_key: str | None = None  # config key of the attention-logit tanh cap (Gemma 2), read when set
    final_softcap_key: str | None = None  # config key of the final-logit tanh cap (Gemma 2)
    sliding: bool = False            # config's sliding_window applies to the layers layer_types names sliding

    @property
    def traits(self) -> list[str]:
        """What this family does beyond a plain pre-norm decoder (words for docs and refusals)."""
        out = []
        if self.norm_offset:
            out.append(f"RMSNorm with ({self.norm_offset:g} + weight)")
        if self.embed_scale:
            out.append("embeddings scaled by sqrt(d_model)")
        if self.post_ln1 or self.post_ln2:
            out.append("norms after attention and the MLP")
        if self.q_norm:
            out.append("q/k norms")
        if self.attn_scale_key:
            out.append(f"attention scale {self.attn_scale_key}^-1/2")
        if self.attn_softcap_key or self.final_softcap_key:
            out.append("tanh soft caps")
        if self.sliding:
            out.append("sliding-window layers")
        return out


GPT2 = Family(blocks="transformer.h", embed="transformer.wte", pos_embed="transformer.wpe",
              final_norm="transformer.ln_f", ln1="ln_1", ln2="ln_2", attn="attn", mlp="mlp",
              qkv="attn.c_attn", qkv_layout="split", attn_out_proj="attn.c_proj", mlp_in="mlp.c_fc",
              mlp_out_proj="mlp.c_proj", conv1d=True)
NEOX = Family(blocks="gpt_neox.layers", embed="gpt_neox.embed_in", pos_embed=None,
              final_norm="gpt_neox.final_layer_norm", ln1="input_layernorm",
              ln2="post_attention_layernorm", attn="attention", mlp="mlp", qkv="attention.query_key_value",
              qkv_layout="per_head", attn_out_proj="attention.dense", mlp_in="mlp.dense_h_to_4h",
              mlp_out_proj="mlp.dense_4h_to_h")
LLAMA = Family(blocks="model.layers", embed="model.embed_tokens", pos_embed=None, final_norm="model.norm",
               ln1="input_layernorm", ln2="post_attention_layernorm", attn="self_attn", mlp="mlp",
               qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), qkv_layout="separate",
               attn_out_proj="self_attn.o_proj", mlp_in="mlp.gate_proj", mlp_out_proj="mlp.down_proj",
               mlp_up="mlp.up_proj")
_GEMMA_PATHS = dict(blocks="model.layers", embed="model.embed_tokens", pos_embed=None, final_norm="model.norm",
                    ln1="input_layernorm", attn="self_attn", mlp="mlp",
                    qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), qkv_layout="separate",
                    attn_out_proj="self_attn.o_proj", mlp_in="mlp.gate_proj", mlp_out_proj="mlp.down_proj",
                    mlp_up="mlp.up_proj", norm_offset=1.0, embed_scale="sqrt_d_model")
GEMMA = Family(ln2="post_attention_layernorm", **_GEMMA_PATHS)  # Gemma 1: HF's post_attention_layernorm is pre-MLP
GEMMA2 = Family(ln2="pre_feedforward_layernorm", post_ln1="post_attention_layernorm",
                post_ln2="post_feedforward_layernorm", attn_scale_key="query_pre_attn_scalar",
                attn_softcap_key="attn_logit_softcapping", final_softcap_key="final_logit_softcapping", sliding=True,
                **_GEMMA_PATHS)
# Gemma 3's attention ignores attn_logit_softcapping (HuggingFace passes no cap): none is read
GEMMA3 = Family(ln2="pre_feedforward_layernorm", post_ln1="post_attention_layernorm",
                post_ln2="post_feedforward_layernorm", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
                attn_scale_key="query_pre_attn_scalar", final_softcap_key="final_logit_softcapping", sliding=True,
                **_GEMMA_PATHS)
FAMILIES: dict[str, Family] = {"GPT2LMHeadModel": GPT2, "GPTNeoXForCausalLM": NEOX, "LlamaForCausalLM": LLAMA,
                               "Qwen2ForCausalLM": LLAMA, "MistralForCausalLM": LLAMA, "GemmaForCausalLM": GEMMA,
                               "Gemma2ForCausalLM": GEMMA2, "Gemma3ForCausalLM": GEMMA3}
PLAIN = Family(blocks="", embed="", pos_embed=None, final_norm="", ln1="", ln2="", attn="", mlp="", qkv="",
               qkv_layout="", attn_out_proj="", mlp_in="", mlp_out_proj="")  # no trait: a plain pre-norm decoder


def traits_of(architecture: str) -> Family | None:
    """The family row of an architecture (its traits), or None when entoscope has none."""
    return FAMILIES.get(architecture)


def config_traits(fam: Family, cfg: Any, n_layers: int, d_model: int, d_head: int) -> dict[str, Any]:
    """The structure record's family fields, read from a HuggingFace config through the family row."""
    def softcap(key: str | None) -> float | None:
        value = getattr(cfg, key, None) if key else None
        return float(value) if value else None

    sliding_layers: tuple[int, ...] = ()
    window = getattr(cfg, "sliding_window", None) if fam.sliding else None
    if window:
        types = list(getattr(cfg, "layer_types", None) or [])
        if len(types) != n_layers:  # Gemma 2's older configs: every other layer, from layer 0
            types = ["sliding_attention" if L % 2 == 0 else "full_attention" for L in range(n_layers)]
        sliding_layers = tuple(L for L, t in enumerate(types) if t == "sliding_attention")
    scalar = getattr(cfg, fam.attn_scale_key, None) if fam.attn_scale_key else None
    return {"norm_offset": fam.norm_offset,
            "embed_scale": float(d_model) ** 0.5 if fam.embed_scale == "sqrt_d_model" else 1.0,
            "post_norms": bool(fam.post_ln1 and fam.post_ln2), "qk_norm": fam.q_norm is not None,
            "attn_scale": float(scalar) ** 0.5 if scalar else float(d_head) ** 0.5,
            "attn_softcap": softcap(fam.attn_softcap_key), "final_softcap": softcap(fam.final_softcap_key),
            "sliding_window": int(window) if sliding_layers else None, "sliding_layers": sliding_layers}


def family_of(hf: Any) -> Family:
    arch = type(hf).__name__
    if arch not in FAMILIES:
        raise UnsupportedModelError(
            f"entoscope has no module map for {arch} (known: {', '.join(FAMILIES)})", code="hf_family_unknown",
            remedy="use a known family, or wrap the model in a TransformerBridge (TransformerBridge.boot_transformers)")
    return FAMILIES[arch]


def get(module: Any, path: str) -> Any:
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def unembed_path(hf: Any) -> str:
    """Where the unembedding sits (HuggingFace's own get_output_embeddings: NeoX renamed embed_out to lm_head)."""
    target = hf.get_output_embeddings()
    return next(name for name, mod in hf.named_modules() if mod is target)


def structure_of(hf: Any, backend: str) -> Structure:
    """The structure record from a HuggingFace config (plain numbers: nothing folded)."""
    cfg, arch = hf.config, type(hf).__name__
    fam = family_of(hf)
    d_model = int(getattr(cfg, "n_embd", None) or cfg.hidden_size)
    n_heads = int(getattr(cfg, "n_head", None) or cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    d_head = int(getattr(cfg, "head_dim", None) or d_model // n_heads)
    n_layers = int(getattr(cfg, "n_layer", None) or cfg.num_hidden_layers)
    d_mlp = int(getattr(cfg, "n_inner", None) or getattr(cfg, "intermediate_size", None) or 4 * d_model)
    n_ctx = int(getattr(cfg, "n_positions", None) or cfg.max_position_embeddings)
    act = str(getattr(cfg, "activation_function", None) or getattr(cfg, "hidden_act", None)
              or getattr(cfg, "hidden_activation", None))
    blocks = get(hf, fam.blocks)
    rms = "rmsnorm" if "RMSNorm" in type(getattr(blocks[0], fam.ln1)).__name__ else "layernorm"
    return Structure(
        architecture=arch, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, d_model=d_model, d_head=d_head,
        d_mlp=d_mlp, d_vocab=int(cfg.vocab_size), n_ctx=n_ctx, norm=rms, norm_folded=False,  # type: ignore[arg-type]
        positional="learned" if fam.pos_embed else "rotary",
        parallel=bool(getattr(cfg, "use_parallel_residual", False)), gated_mlp=fam.mlp_up is not None,
        act_fn=act, backend=backend, mode="plain", tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),  # type: ignore[arg-type]
        **config_traits(fam, cfg, n_layers, d_model, d_head),
    )


def _linear(module: Any, conv1d: bool) -> Tensor:
    """A projection's weight as [in, out]."""
    return module.weight if conv1d else module.weight.T


def _bias(module: Any) -> Tensor | None:
    return getattr(module, "bias", None)


class HFWeights(Weights):
    """`Weights` read from a HuggingFace model's own modules (views of its parameters)."""

    def __init__(self, hf: Any, structure: Structure) -> None:
        super().__init__(hf, structure)
        self.fam = family_of(hf)
        self._blocks = get(hf, self.fam.blocks)
        self._unembed = unembed_path(hf)

    def _block(self, layer: int, path: str) -> Any:
        return get(self._blocks[layer], path)

    @property
    def W_E(self) -> Tensor:
        return get(self._tl, self.fam.embed).weight

    @property
    def W_pos(self) -> Tensor:
        if self.fam.pos_embed is None:
            return super().W_pos  # refuses: rotary positions
        return get(self._tl, self.fam.pos_embed).weight

    @property
    def W_U(self) -> Tensor:
        return get(self._tl, self._unembed).weight.T

    @property
    def b_U(self) -> Tensor:
        b = _bias(get(self._tl, self._unembed))
        return b if b is not None else torch.zeros(self.s.d_vocab, dtype=self.W_U.dtype, device=self.W_U.device)

    def _qkv(self, layer: int, which: str) -> tuple[Tensor, Tensor | None]:
        """(W [n, d_model, d_head], b [n, d_head] or None) of q (n_heads) or k/v (n_kv_heads)."""
        s, fam = self.s, self.fam
        i = "qkv".index(which)
        n = s.n_heads if which == "q" else s.n_kv_heads
        if fam.qkv_layout == "separate":
            mod = self._block(layer, fam.qkv[i])
            W = _linear(mod, fam.conv1d).reshape(s.d_model, n, s.d_head).transpose(0, 1)
            b = _bias(mod)
            return W, None if b is None else b.reshape(n, s.d_head)
        mod = self._block(layer, fam.qkv)  # type: ignore[arg-type]
        W, b = _linear(mod, fam.conv1d), _bias(mod)  # [d_model, 3 * n * d_head]
        if fam.qkv_layout == "split":
            cols = slice(i * s.n_heads * s.d_head, (i + 1) * s.n_heads * s.d_head)
            W, b = W[:, cols], None if b is None else b[cols]
            return W.reshape(s.d_model, n, s.d_head).transpose(0, 1), None if b is None else b.reshape(n, s.d_head)
        W = W.reshape(s.d_model, n, 3, s.d_head)[:, :, i]  # per head [q k v]
        return W.transpose(0, 1), None if b is None else b.reshape(n, 3, s.d_head)[:, i]

    def W_Q(self, layer: int) -> Tensor:
        return self._qkv(layer, "q")[0]

    def b_Q(self, layer: int) -> Tensor:
        b = self._qkv(layer, "q")[1]
        return b if b is not None else torch.zeros(self.s.n_heads, self.s.d_head, dtype=self.W_E.dtype,
                                                   device=self.W_E.device)

    def W_K_kv(self, layer: int) -> Tensor:
        return self._qkv(layer, "k")[0]

    def W_V_kv(self, layer: int) -> Tensor:
        return self._qkv(layer, "v")[0]

    def W_K(self, layer: int) -> Tensor:
        return self._per_query_head(self.W_K_kv(layer))

    def W_V(self, layer: int) -> Tensor:
        return self._per_query_head(self.W_V_kv(layer))

    def _kv_bias(self, layer: int, which: str) -> Tensor:
        b = self._qkv(layer, which)[1]
        if b is None:
            return torch.zeros(self.s.n_heads, self.s.d_head, dtype=self.W_E.dtype, device=self.W_E.device)
        return self._per_query_head(b)

    def b_K(self, layer: int) -> Tensor:
        return self._kv_bias(layer, "k")

    def b_V(self, layer: int) -> Tensor:
        return self._kv_bias(layer, "v")

    def W_O(self, layer: int) -> Tensor:
        mod = self._block(layer, self.fam.attn_out_proj)
        return _linear(mod, self.fam.conv1d).reshape(self.s.n_heads, self.s.d_head, self.s.d_model)

    def b_O(self, layer: int) -> Tensor:
        b = _bias(self._block(layer, self.fam.attn_out_proj))
        return b if b is not None else torch.zeros(self.s.d_model, dtype=self.W_E.dtype, device=self.W_E.device)

    def W_in(self, layer: int) -> Tensor:
        return _linear(self._block(layer, self.fam.mlp_up or self.fam.mlp_in), self.fam.conv1d)

    def b_in(self, layer: int) -> Tensor:
        b = _bias(self._block(layer, self.fam.mlp_up or self.fam.mlp_in))
        return b if b is not None else torch.zeros(self.s.d_mlp, dtype=self.W_E.dtype, device=self.W_E.device)

    def W_gate(self, layer: int) -> Tensor | None:
        return _linear(self._block(layer, self.fam.mlp_in), self.fam.conv1d) if self.fam.mlp_up else None

    def W_out(self, layer: int) -> Tensor:
        return _linear(self._block(layer, self.fam.mlp_out_proj), self.fam.conv1d)

    def b_out(self, layer: int) -> Tensor:
        b = _bias(self._block(layer, self.fam.mlp_out_proj))
        return b if b is not None else torch.zeros(self.s.d_model, dtype=self.W_E.dtype, device=self.W_E.device)

    def norm(self, layer: int, which: str) -> Norm:
        return self._norm(self._block(layer, self.fam.ln1 if which == "ln1" else self.fam.ln2))

    def qk_norm(self, layer: int, which: str) -> Norm:
        """The per-head norm of q ("q") or k ("k") before rotary (families with q/k norms)."""
        path = self.fam.q_norm if which == "q" else self.fam.k_norm
        assert path is not None
        return self._norm(self._block(layer, path), post=True)

    def post_norm(self, layer: int, which: str) -> Norm | None:
        path = self.fam.post_ln1 if which == "attn" else self.fam.post_ln2
        return self._norm(self._block(layer, path), post=True) if path and self.s.post_norms else None

    @property
    def final_norm(self) -> Norm:
        return self._norm(get(self._tl, self.fam.final_norm))

    def _eps(self, module: Any) -> float:
        for attr in ("eps", "variance_epsilon"):
            value = getattr(module, attr, None)
            if isinstance(value, (int, float)):
                return float(value)
        raise UnsupportedModelError(f"cannot read the epsilon of {type(module).__name__}", code="hf_family_unknown",
                                    remedy="use a TransformerBridge for this model")
