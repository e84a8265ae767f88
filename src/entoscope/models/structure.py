"""The structure record: what every operation needs to know about a model's shape and layout."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Structure:
    """Shape and layout of a model, the same fields whatever the backend.

    norm_folded: True when the norms' weights were folded into the next linear maps (a
    HookedTransformer with TransformerLens's processing, or a bridge in compatibility mode): then
    the normalised activations (attn_in, mlp_in) carry no learned scale, and writing weights are
    centred. Numbers read at those sites mean something different from a plain bridge's.
    """

    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    norm: Literal["layernorm", "rmsnorm"]
    norm_folded: bool
    positional: Literal["learned", "rotary"]
    parallel: bool
    gated_mlp: bool
    act_fn: str
    backend: Literal["bridge", "hooked"]
    mode: Literal["plain", "compat", "processed", "unprocessed"]
    tied_embeddings: bool
    quantization: str | None = None  # weights read from a quantized file (GGUF) and dequantized: not the checkpoint

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """A few human lines (the `entoscope info` printout)."""
        gqa = f" ({self.n_kv_heads} key/value heads)" if self.n_kv_heads != self.n_heads else ""
        return "\n".join([
            f"architecture   {self.architecture}  [{self.backend}, {self.mode}]",
            f"layers         {self.n_layers}, {'parallel' if self.parallel else 'sequential'} attention+MLP",
            f"heads          {self.n_heads}{gqa}, d_head {self.d_head}",
            f"d_model        {self.d_model}, d_mlp {self.d_mlp} ({'gated' if self.gated_mlp else 'plain'} "
            f"{self.act_fn})",
            f"vocabulary     {self.d_vocab}, context {self.n_ctx}, "
            f"{'tied' if self.tied_embeddings else 'untied'} embeddings",
            f"norm           {self.norm}{' (folded)' if self.norm_folded else ''}, "
            f"{self.positional} positions",
        ] + ([f"weights        dequantized from {self.quantization} to float32 (not the original checkpoint)"]
             if self.quantization else []))
