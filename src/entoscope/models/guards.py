"""Checks that keep a run from returning numbers it cannot stand behind.

- `evaluating(tl)`: a model left in train mode runs with dropout, so two identical runs differ.
  Operations run it in eval mode, say so (a recorded warning when dropout was active) and restore
  every module's own mode afterwards.
- `check_finite_weights(tl)`: NaN or inf in a parameter is refused, naming the parameter.
- `first_non_finite(...)`: when a run's output is not finite, find the first site (in the order
  the forward reaches them) whose value is not, so the error can say where it first appeared.
- `check_describable(adapter)` and `check_unembedding(adapter)` check what every operation assumes of a
  decoder: causal attention (a later token does not change earlier positions), an additive residual
  stream (resid_post = resid_pre + attn_out + mlp_out), both from a tiny forward that stops after
  block 0 when the model is adapted; and pre-norm logits (unembed(final_norm(last resid_post)) = the
  model's logits), shown on the first forward entoscope makes of the model (ModelAdapter.run reads
  the last block's output beside the logits it returns) or by its own tiny forward when the
  unembedding or a forward without logits comes first (`CheckedWeights`). An encoder or a post-norm
  model fails one of them and is refused, instead of being described as a decoder it is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..errors import CheckFailedError, UnsupportedModelError, warn
from .fingerprint import weights_stamp

if TYPE_CHECKING:
    from .adapter import ModelAdapter
    from .weights import Weights


@contextlib.contextmanager
def evaluating(tl: Any) -> Iterator[None]:
    """Run `tl` in eval mode inside the block; restore each module's mode after."""
    modes = [(m, m.training) for m in tl.modules()]
    if any(training for _, training in modes):
        dropout = [m for m, training in modes if training and isinstance(m, torch.nn.modules.dropout._DropoutNd)
                   and float(getattr(m, "p", 0.0)) > 0]
        if dropout:
            warn(f"the model was in train mode with {len(dropout)} active dropout module(s) (p = "
                 f"{max(float(m.p) for m in dropout):g}); entoscope ran it in eval mode (dropout off) and then "
                 "put it back in train mode", code="train_mode_switched")
        tl.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def check_finite_weights(tl: Any) -> None:
    """Refuse NaN/inf in any parameter. Scanned once per weights version (`weights_stamp`: an in-place edit,
    a replaced tensor or a move scans again), by `non_finite`: one read of the weights on their device."""
    stamp = weights_stamp(tl)
    if tl.__dict__.get("_entoscope_finite_stamp") == stamp:
        return
    params = [(n, p) for n, p in tl.named_parameters() if p.numel() and not p.is_meta]
    for i in non_finite([p for _, p in params]):
        name, p = params[i]
        name = name.replace("_original_component.", "")  # the bridge's wrapper modules add nothing
        raise CheckFailedError(f"the model's weight {name} holds {_count_non_finite(p)} non-finite value(s) (NaN "
                               "or inf)", code="non_finite_weights",
                               remedy="load the weights again, or find what wrote NaN/inf into them")
    tl._entoscope_finite_stamp = stamp


def non_finite(tensors: Sequence[Tensor]) -> list[int]:
    """Indices of the floating-point tensors that hold NaN or inf, in order.

    One sum per storage (float32 or wider accumulation), one host sync per device: a sum is finite unless
    the values hold NaN/inf or the sum overflowed, so only a tensor whose storage's sum is not finite is
    then read element by element (in chunks). Tensors that are views of one storage (a bridge's q, k, v
    of a joint qkv weight, a tied embedding) are read once, as the whole storage, where they cover it. A
    clean set of tensors costs one read of their bytes (an elementwise isfinite pass costs several and a
    bool copy of each)."""
    by_storage: dict[tuple[torch.device, int, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_floating_point() and t.numel():
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr(), t.dtype), []).append(i)
    by_device: dict[torch.device, list[tuple[Tensor, list[int]]]] = {}
    for (device, _, _), idx in by_storage.items():
        first = tensors[idx[0]].detach()
        whole = first.untyped_storage().nbytes() // first.element_size()
        if len(idx) > 1 and whole <= sum(tensors[i].numel() for i in idx):  # the views cover their storage
            reads = [(first.new_empty(0).set_(first.untyped_storage(), 0, (whole,)), idx)]
        else:
            reads = [(tensors[i].detach(), [i]) for i in idx]
        by_device.setdefault(device, []).extend(reads)
    suspects: list[int] = []
    with torch.no_grad():
        for reads in by_device.values():
            sums = torch.stack([t.sum(dtype=_accumulator(t.dtype)) for t, _ in reads])
            suspects += [i for (_, idx), ok in zip(reads, torch.isfinite(sums).tolist()) if not ok for i in idx]
    return [i for i in sorted(suspects) if _count_non_finite(tensors[i])]


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _count_non_finite(t: Tensor, chunk: int = 1 << 22) -> int:
    flat = t.detach().reshape(-1)
    return sum(int((~torch.isfinite(flat[i:i + chunk])).sum()) for i in range(0, flat.numel(), chunk))


def first_non_finite(adapter: ModelAdapter, tokens: Tensor, interventions: Sequence[tuple[Any, Any]]) -> str | None:
    """The first site (in the order the forward reaches them) whose value is not finite, re-running the
    same forward with the same interventions (base interventions, ModelAdapter.lower)."""
    backend = adapter.backend
    written = {act for act, _ in interventions}
    through = {backend.written_through(act): act for act in written}  # where each write takes effect
    with torch.no_grad():
        _, acts = backend.run(tokens, backend.sites(adapter.structure), list(interventions), logits=False)
    for act, x in acts.items():  # in the order they were reached
        if act.kind != "attn_scores" and x.is_floating_point() and not bool(torch.isfinite(x).all()):
            act = through.get(act, act)  # name the site the user wrote, not where the backend wrote it
            return f"{act} (hook {backend.key(act)})" + (", where an intervention writes" if act in written else "")
    return None


def raise_non_finite(what: str, where: str | None) -> None:
    place = f"; it first appears at {where}" if where else ""
    raise CheckFailedError(f"{what} holds NaN or inf{place}", code="non_finite",
                           remedy="check the weights and any patch value or intervention written at that point; "
                           "a float16 model may overflow: load it in float32 or bfloat16")


CHECK_COLUMNS = 4096  # vocabulary columns of the unembedding check
_NOT_A_DECODER = ("entoscope describes causal decoders whose residual stream adds up and whose logits are "
                  "unembed(final_norm(last resid_post)), modelled per family (docs/families.md: GPT-2, GPT-NeoX, "
                  "Llama, Qwen2, Mistral, Gemma 1/2/3); an encoder (BERT) fails the causal check, and a decoder "
                  "of another family fails here when it computes something its family row does not say: add one "
                  "(models/hf_families.py)")


def check_describable(adapter: ModelAdapter) -> None:
    """Causal attention and an additive residual stream, from one forward of two 4-token prompts differing
    in their last token that stops after block 0 (an encoder or a post-norm block fails there as at every
    block). Run once per weights version (`weights_stamp`)."""
    tl = adapter.module
    stamp = weights_stamp(tl)
    if tl.__dict__.get("_entoscope_describable") == stamp:
        return
    s = adapter.structure
    tokens = _check_tokens(adapter)
    names = {k: adapter.resolve(k) for k in ("resid_pre.0", "attn_out.0", "mlp_out.0", "resid_post.0")}
    with torch.no_grad(), evaluating(tl):
        _, acts = adapter.backend.run(tokens, list(names.values()), [], logits=False)  # stops after block 0
    resid = {k: acts[a].double() for k, a in names.items()}
    problems = []
    post = resid["resid_post.0"]
    tol = _tolerance(acts[names["resid_post.0"]].dtype)
    rscale = float(post.abs().max()) + 1e-6
    if tokens.shape[1] > 1 and not float((post[1, :-1] - post[0, :-1]).abs().max()) <= tol * rscale:
        problems.append("changing the last token changed block 0's output at earlier positions: its attention "
                        "is not causal (an encoder?)")
    summed = resid["resid_pre.0"] + resid["attn_out.0"] + resid["mlp_out.0"]
    if not float((summed - post).abs().max()) <= tol * rscale:
        problems.append("resid_post is not resid_pre + attn_out + mlp_out: the residual stream is not additive "
                        "(a post-norm block?)")
    if problems:
        raise UnsupportedModelError(f"{s.architecture} is not a model entoscope can describe: " + "; ".join(problems),
                                    code="not_a_decoder", remedy=_NOT_A_DECODER)
    tl._entoscope_describable = stamp


def unembedding_checked(adapter: ModelAdapter) -> bool:
    """Whether this weights version's logits were shown to be unembed(final_norm(last resid_post))."""
    return adapter.module.__dict__.get("_entoscope_unembeds") == weights_stamp(adapter.module)


def check_unembedding(adapter: ModelAdapter, final: Tensor | None = None, logits: Tensor | None = None) -> None:
    """Refuse a model whose logits are not unembed(final_norm(last resid_post)) (an unmodelled logit cap, a
    post-norm model, an unembedding read wrongly): what every decomposition of the logits assumes. A family's
    final-logit soft cap (structure.final_softcap, Gemma 2) is applied to the unembedding before comparing:
    the operations that decompose the logits linearly refuse such a model (`require_linear_logits`).

    `final` [k, d_model] and `logits` [k, d_vocab] are the last block's output and the model's logits at the
    same k positions of a forward entoscope made anyway (ModelAdapter.run); without them, one forward of
    a 4-token prompt makes them. Compared on the first CHECK_COLUMNS token ids, in float32 (a post-norm
    model differs at every one; float32's rounding is far below the tolerance)."""
    tl = adapter.module
    if final is None or logits is None:
        last = adapter.resolve(f"resid_post.{adapter.structure.n_layers - 1}")
        with torch.no_grad(), evaluating(tl):
            out, acts = adapter.backend.run(_check_tokens(adapter)[:1], [last], [])
        final, logits = acts[last][0], out[0]
    s = adapter.structure
    weights = adapter.weights.unchecked
    cols = slice(0, min(s.d_vocab, CHECK_COLUMNS))
    with torch.no_grad():
        W_U, b_U = weights.W_U[:, cols], weights.b_U[cols]
        wide = _accumulator(W_U.dtype)
        normed = weights.final_norm(final.detach()).to(wide)
        unembedded = (normed @ W_U.to(wide) + b_U.to(wide)).double()
        if s.final_softcap:  # Gemma 2: logits = c * tanh(unembedded / c), the family's final cap
            unembedded = s.final_softcap * torch.tanh(unembedded / s.final_softcap)
    logits = logits.detach()
    scale = float(logits.float().abs().max()) + 1e-6
    tol = _tolerance(logits.dtype)
    if not float((unembedded - logits[..., cols].double()).abs().max()) <= tol * scale:
        raise UnsupportedModelError(
            f"{s.architecture} is not a model entoscope can describe: unembed(final_norm(last resid_post)) is "
            "not the model's logits", code="not_a_decoder", remedy=_NOT_A_DECODER)
    tl._entoscope_unembeds = weights_stamp(tl)


def require_linear_logits(adapter: ModelAdapter, what: str) -> None:
    """Refuse `what` (an operation that splits the logits into a sum of components) on a model whose logits
    pass through a tanh soft cap (Gemma 2's final_logit_softcapping): no sum of parts is its logits."""
    s = adapter.structure
    if s.final_softcap:
        raise UnsupportedModelError(
            f"{what} splits the logits into a sum of components, but {s.architecture}'s logits are "
            f"{s.final_softcap:g} * tanh(unembedded / {s.final_softcap:g}) (a final soft cap), which no sum "
            "of parts equals", code="logit_softcap",
            remedy="use an operation that does not decompose the logits (lens, patching, attribution, EAP "
            "with a metric), or a family without a final soft cap (Gemma 3)")


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype in (torch.float32, torch.float64) else 3e-2  # half precision rounds at ~1e-3


def _check_tokens(adapter: ModelAdapter) -> Tensor:
    """Two prompts of min(4, n_ctx) tokens, differing in their last token."""
    s = adapter.structure
    n = min(4, s.n_ctx)
    tokens = torch.arange(1, n + 1, device=adapter.device).remainder(s.d_vocab)[None].repeat(2, 1)
    tokens[1, -1] = (tokens[1, -1] + 1) % s.d_vocab
    return tokens


class CheckedWeights:
    """A model's `Weights` whose unembedding (W_U, b_U, final_norm) is handed out only once the model's logits
    are shown to be unembed(final_norm(last resid_post)) for these weights (`check_unembedding`). Every other
    name is the weights' own; `unchecked` is the `Weights` itself."""

    _GUARDED = frozenset({"W_U", "b_U", "final_norm"})

    def __init__(self, weights: Weights, before_unembedding: Callable[[], None]) -> None:
        self.unchecked = weights
        self._before = before_unembedding

    def __getattr__(self, name: str) -> Any:
        if name in CheckedWeights._GUARDED:
            self._before()
        return getattr(self.unchecked, name)
