"""Starting a TransformerBridge part-way: its blocks L.. called in order, from a given residual stream.

The bridge hands the layer loop to HuggingFace (its own `start_at_layer`, where it exists, still
runs blocks 0..L-1 and discards them). Here the bridge's blocks are called directly, with the
arguments the family's HuggingFace model would give them, so every hook of blocks L.. fires as in a
full forward and nothing below L runs:

  position_ids         the run's absolute positions (P..T-1 when the run starts at position P)
  position_embeddings  rotary families: (cos, sin) from the model's own rotary module at those positions
  attention_mask       None: the bridge's attention builds the causal mask itself, offset by the prefix
  layer_past           a frozen key/value prefix (`FrozenPrefix`) when the run starts at position P > 0

The prefix goes in as `layer_past`, the name the bridge's attention reads its cache from. (The
HuggingFace decoder layers of transformers 5.x hand their cache on as `cache=`, which the bridge's
attention ignores: a plain bridge forward with `past_key_values` on GPT-2 or Llama silently attends
to the new tokens only. That is why nothing here relies on HuggingFace's own cache plumbing.)

What the attention caches is recorded by running the same blocks over the whole prompt with a
`Recorder` as the prefix (`record`): keys after rotary, in the attention's own layout.

Each recipe is checked once per model, on first use, by a tiny forward (`support`): the residual
after the last block, reached by starting at a middle layer (and a middle position, with the recorded
prefix), must equal the bridge's own full forward. A model whose check fails gets the full-forward
path, and the reason is kept for the plan's notes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# the families whose blocks entoscope calls directly: where the HuggingFace model keeps its rotary module
# (None: positions are added to the embeddings, the blocks need none)
ROTARY_MODULE: dict[str, str | None] = {
    "GPT2LMHeadModel": None,
    "GPTNeoXForCausalLM": "gpt_neox.rotary_emb",
    "LlamaForCausalLM": "model.rotary_emb",
    "Qwen2ForCausalLM": "model.rotary_emb",
    "MistralForCausalLM": "model.rotary_emb",
}
CHECK_TOKENS = (2, 6)  # the check's batch: prompts x tokens


class FrozenPrefix:
    """Keys/values of the positions before a run's first position, per block, handed to the bridge's
    attention as its cache: update() returns them joined to the new positions' and keeps nothing, so one
    prefix serves any number of runs. keys[l], values[l]: [R, n_kv_heads, P, d_head]."""

    def __init__(self, keys: dict[int, Tensor], values: dict[int, Tensor]) -> None:
        self.keys, self.values = keys, values

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        past_k, past_v = self.keys[layer_idx], self.values[layer_idx]
        return (torch.cat([past_k.to(key.dtype), key], dim=2), torch.cat([past_v.to(value.dtype), value], dim=2))


class Recorder:
    """A cache that keeps what each block's attention would cache ([B, n_kv_heads, T, d_head]) and adds nothing."""

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value


def _rotary(tl: Any, architecture: str) -> Any:
    path = ROTARY_MODULE.get(architecture)
    if path is None:
        return None
    module = tl.original_model
    for part in path.split("."):
        module = getattr(module, part)
    return module


def walk(tl: Any, architecture: str, resid: Tensor, layer: int, position: int, *,
         past: FrozenPrefix | Recorder | None = None, hooks: Sequence[tuple[str, Callable]] = (),
         joins: dict[int, Tensor] | None = None) -> Tensor:
    """The residual after the last block [R, T - position, d_model] of runs entering block `layer` with
    `resid` [R, T - position, d_model] at positions position..T-1 (the earlier ones in `past`). Rows in
    `joins[l]` enter at block l, after the rows already running (`past` then holds keys for all rows
    running at each block)."""
    positions = torch.arange(position, position + resid.shape[1], device=resid.device)[None]
    kwargs: dict[str, Any] = {"position_ids": positions, "attention_mask": None, "use_cache": False,
                              "layer_past": past}
    rotary = _rotary(tl, architecture)
    if rotary is not None:
        kwargs["position_embeddings"] = rotary(resid, positions)
    h = resid
    with tl.hooks(fwd_hooks=list(hooks)):
        for L, block in enumerate(tl.blocks[layer:], start=layer):
            if joins and L in joins:
                h = torch.cat([h, joins[L].to(h.dtype)])
            out = block(h, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
    return h


def record(tl: Any, architecture: str, resid: Tensor, layer: int) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """What each block from `layer` on caches, over every position of unpatched runs entering block `layer`
    with `resid` [B, T, d_model]: (keys, values) by layer, [B, n_kv_heads, T, d_head]."""
    rec = Recorder()
    walk(tl, architecture, resid, layer, 0, past=rec)
    return rec.keys, rec.values


@dataclass(frozen=True)
class Support:
    """What the check found: "positions", "layers" or "none", and why a shortcut was refused (else "")."""

    level: str
    note: str = ""


def support(tl: Any, architecture: str, d_vocab: int, mode: str) -> Support:
    """Which starts this bridge allows, checked once per model (and mode) by a tiny forward."""
    memo = tl.__dict__.setdefault("_entoscope_start_support", {})
    param = next(tl.parameters())
    key = (mode, param.dtype, str(param.device))
    if key not in memo:
        memo[key] = _check(tl, architecture, d_vocab)
    return memo[key]


def _check(tl: Any, architecture: str, d_vocab: int) -> Support:
    if architecture not in ROTARY_MODULE:
        return Support("none", f"entoscope has no recipe to call the blocks of {architecture} one by one")
    n_layers = len(tl.blocks)
    B, T = CHECK_TOKENS
    layer, position = n_layers // 2, T // 2
    device = next(tl.parameters()).device
    tokens = (torch.arange(B * T, device=device).reshape(B, T) * 37 + 1) % d_vocab
    kept: dict[str, Tensor] = {}

    def keep(name: str) -> Callable:
        def hook(x: Tensor, hook: Any = None) -> Tensor:
            kept[name] = x
            return x
        return hook

    names = (f"blocks.{layer}.hook_resid_pre", f"blocks.{n_layers - 1}.hook_resid_post")
    try:
        with torch.no_grad():
            with tl.hooks(fwd_hooks=[(n, keep(n)) for n in names]):
                tl(tokens, return_type=None)
            resid, final = kept[names[0]], kept[names[1]]
            tol = max(1e-4, 64 * torch.finfo(final.dtype).eps) * (1 + float(final.abs().max()))
            keys, values = record(tl, architecture, resid, layer)
            gap = float((walk(tl, architecture, resid, layer, 0) - final).abs().max())
            if not gap <= tol:
                return Support("none", f"calling the blocks from layer {layer} on gave a final residual {gap:.3g} "
                                       f"away from the bridge's own forward")
            prefix = FrozenPrefix({L: k[:, :, :position] for L, k in keys.items()},
                                  {L: v[:, :, :position] for L, v in values.items()})
            gap = float((walk(tl, architecture, resid[:, position:], layer, position, past=prefix)
                         - final[:, position:]).abs().max())
    except Exception as err:  # noqa: BLE001 - any failure of the recipe means: run full forwards
        return Support("none", f"calling the blocks one by one failed ({type(err).__name__}: {err})")
    if not gap <= tol:
        return Support("layers", f"the blocks' attention did not take a key/value prefix (a start at position "
                                 f"{position} gave a final residual {gap:.3g} away from the full forward)")
    return Support("positions")
