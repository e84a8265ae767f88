"""HuggingFace model families as data: where each piece sits in the module tree, the structure record
read from the config, and the weights in entoscope's layout read from the modules.

Used by backends that run a HuggingFace model as it is (nnsight): nothing is converted or folded, so
the numbers are HuggingFace's own, as on a plain TransformerBridge. A family missing here is refused
at load time (`hf_family_unknown`), naming the families that are known.

Weight layouts (HuggingFace -> entoscope, see weights.py for the target shapes):
  GPT-2   Conv1D stores [in, out]; c_attn's output is q | k | v, each [d_model] wide, heads contiguous.
  NeoX    nn.Linear stores [out, in]; query_key_value's output is per head [q_h | k_h | v_h].
  Llama   separate q/k/v projections [heads * d_head, d_model]; k and v have n_kv_heads heads.
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
FAMILIES: dict[str, Family] = {"GPT2LMHeadModel": GPT2, "GPTNeoXForCausalLM": NEOX, "LlamaForCausalLM": LLAMA,
                               "Qwen2ForCausalLM": LLAMA, "MistralForCausalLM": LLAMA}


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
    act = str(getattr(cfg, "activation_function", None) or cfg.hidden_act)
    blocks = get(hf, fam.blocks)
    rms = "rmsnorm" if "RMSNorm" in type(getattr(blocks[0], fam.ln1)).__name__ else "layernorm"
    return Structure(
        architecture=arch, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, d_model=d_model, d_head=d_head,
        d_mlp=d_mlp, d_vocab=int(cfg.vocab_size), n_ctx=n_ctx, norm=rms, norm_folded=False,  # type: ignore[arg-type]
        positional="learned" if fam.pos_embed else "rotary",
        parallel=bool(getattr(cfg, "use_parallel_residual", False)), gated_mlp=fam.mlp_up is not None,
        act_fn=act, backend=backend, mode="plain", tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),  # type: ignore[arg-type]
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
