"""Checks that keep a run from returning numbers it cannot stand behind.

- `evaluating(tl)`: a model left in train mode runs with dropout, so two identical runs differ.
  Operations run it in eval mode, say so (a recorded warning when dropout was active) and restore
  every module's own mode afterwards.
- `check_finite_weights(tl)`: NaN or inf in a parameter is refused, naming the parameter.
- `first_non_finite(...)`: when a run's output is not finite, find the first site (in the order
  the forward reaches them) whose value is not, so the error can say where it first appeared.
- `check_describable(adapter)`: one tiny forward at load time checks what every operation assumes
  of a decoder: causal attention (a later token does not change earlier logits), an additive
  residual stream (resid_post = resid_pre + attn_out + mlp_out) and pre-norm logits
  (unembed(final_norm(last resid_post)) = the model's logits). An encoder or a post-norm model
  fails one of them and is refused, instead of being described as a decoder it is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..errors import CheckFailedError, UnsupportedModelError, warn
from .fingerprint import weights_stamp

if TYPE_CHECKING:
    from .adapter import ModelAdapter


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

    One sum per tensor (float32 or wider accumulation), one host sync per device: a sum is finite unless
    the tensor holds NaN/inf or the sum overflowed, so only a tensor whose sum is not finite is then read
    element by element (in chunks). A clean set of tensors costs one read of their values (an elementwise
    isfinite pass costs several and a bool copy of each)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_floating_point() and t.numel():
            by_device.setdefault(t.device, []).append(i)
    suspects: list[int] = []
    with torch.no_grad():
        for idx in by_device.values():
            sums = torch.stack([tensors[i].detach().sum(dtype=_accumulator(tensors[i].dtype)) for i in idx])
            suspects += [i for i, ok in zip(idx, torch.isfinite(sums).tolist()) if not ok]
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


CHECK_COLUMNS = 4096  # vocabulary columns of the pre-norm logits check


def check_describable(adapter: ModelAdapter) -> None:
    """One forward of two 4-token prompts differing in their last token: causal, additive residual stream,
    pre-norm logits. Run once per weights version (`weights_stamp`)."""
    tl = adapter.module
    stamp = weights_stamp(tl)
    if tl.__dict__.get("_entoscope_describable") == stamp:
        return
    s = adapter.structure
    n = min(4, s.n_ctx)
    tokens = torch.arange(1, n + 1, device=adapter.device).remainder(s.d_vocab)[None].repeat(2, 1)
    tokens[1, -1] = (tokens[1, -1] + 1) % s.d_vocab  # the second prompt: another last token
    last = s.n_layers - 1
    names = {k: adapter.resolve(k) for k in (f"resid_pre.{last}", f"attn_out.{last}", f"mlp_out.{last}",
                                             f"resid_post.{last}")}
    with torch.no_grad(), evaluating(tl):
        both, acts = adapter.backend.run(tokens, list(names.values()), [])
        logits, logits2 = both[:1], both[1:]
        resid = {k: acts[a][:1].double() for k, a in names.items()}
        # unembedded by hand at the first CHECK_COLUMNS token ids (a post-norm model differs at every one); in
        # float32 (no float64 copy of W_U): its rounding is far below the tolerance
        cols = slice(0, min(s.d_vocab, CHECK_COLUMNS))
        W_U, b_U = adapter.weights.W_U[:, cols], adapter.weights.b_U[cols]
        wide = _accumulator(W_U.dtype)
        final = adapter.weights.final_norm(acts[names[f"resid_post.{last}"]][:1]).to(wide)
        unembedded = (final @ W_U.to(wide) + b_U.to(wide)).double()
    scale = float(logits.float().abs().max()) + 1e-6
    tol = 1e-3 if logits.dtype in (torch.float32, torch.float64) else 3e-2  # half precision rounds at ~1e-3
    problems = []
    if n > 1 and not float((logits2[0, :-1].float() - logits[0, :-1].float()).abs().max()) <= tol * scale:
        problems.append("changing the last token changed the logits at earlier positions: its attention is "
                        "not causal (an encoder?)")
    summed = resid[f"resid_pre.{last}"] + resid[f"attn_out.{last}"] + resid[f"mlp_out.{last}"]
    rscale = float(resid[f"resid_post.{last}"].abs().max()) + 1e-6
    if not float((summed - resid[f"resid_post.{last}"]).abs().max()) <= tol * rscale:
        problems.append("resid_post is not resid_pre + attn_out + mlp_out: the residual stream is not additive "
                        "(a post-norm block?)")
    elif not float((unembedded - logits[..., cols].double()).abs().max()) <= tol * scale:
        problems.append("unembed(final_norm(last resid_post)) is not the model's logits")
    if problems:
        raise UnsupportedModelError(
            f"{s.architecture} is not a model entoscope can describe: " + "; ".join(problems),
            code="not_a_decoder",
            remedy="entoscope supports pre-norm decoder-only transformers (GPT-2, GPT-NeoX/Pythia, Llama, Qwen2, "
            "Mistral, ...); encoders (BERT) and encoder-decoders (T5) are not supported")
    tl._entoscope_describable = stamp
