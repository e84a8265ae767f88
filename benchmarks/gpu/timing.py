"""Timings against the floor: EAP-IG over N IOI prompts and an exact layer x position sweep over N pairs,
each next to the plain model passes it needs, run on the same batches in the same script.

Floors (the model's own work, with nothing of entoscope in between: the HuggingFace module under the
TransformerBridge, called directly):
- EAP-IG (`steps` integration points): per prompt, 2 forwards without gradients (clean and corrupt runs)
  and `steps` forward + backward passes (the logit difference at the last token, differentiated with
  respect to the input embeddings: the backward goes through every block), on the operation's own batches.
  These are the counts the operation's plan gives (forward_passes - backward_passes, backward_passes).
- exact sweep (resid_pre, every layer x every position): per pair, 2 whole forwards (clean and corrupt
  runs) plus, for every cell (layer l, position p), the blocks l..L-1 of a patched run: (L - l) / L of a
  forward. They are run as whole forwards of the operation's batches (rounded up). Positions before p are
  not discounted (a sweep that reuses the prefix's keys and values skips them), so a sweep can beat this
  floor: the ratio then reads below 1.

Peak memory: torch.cuda.max_memory_allocated on a GPU (everything allocated, the model included); on the
CPU the largest rise of the bytes malloc hands out during the call (benchmarks/common.PeakMemory).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

TARGETS = {"eap_ig": 60.0, "exact_sweep": 120.0}  # seconds on one H200 for 1,000 prompts / pairs
TARGET_RATIO = 2.0  # each within 2x of its floor


@dataclass
class Timing:
    name: str
    model: str
    dtype: str
    device: str
    n: int
    n_requested: int
    seconds: float = float("nan")
    floor_seconds: float = float("nan")
    ratio: float = float("nan")
    per_1000_s: float = float("nan")  # seconds scaled to 1,000 prompts (linear in prompts)
    peak_mib: float = float("nan")
    floor_peak_mib: float = float("nan")
    forward_passes: int = 0
    backward_passes: int = 0
    floor_forwards: int = 0
    floor_backwards: int = 0
    target_s: float = float("nan")
    meets: str = "-"  # "yes" / "no" against the H200 targets (on a GPU only), "-" elsewhere
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


class Peak:
    """Peak memory of a block, in MiB (see the module docstring)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __enter__(self) -> Peak:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            from common import PeakMemory

            self._mem = PeakMemory().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.mib = torch.cuda.max_memory_allocated() / 2**20
        else:
            self._mem.__exit__(*exc)
            self.mib = self._mem.rise / 2**20


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_module(model: Any) -> Any:
    from entoscope.models.adapter import adapt

    module = adapt(model).module
    return getattr(module, "original_model", module)


def _last(batch: Any, device: Any) -> torch.Tensor:
    return (batch.lengths - 1).to(device)


def floor_passes(hf: Any, batches: list[Any], forwards: int, backwards: int, device: str) -> None:
    """Per batch: `forwards` forwards without gradients, `backwards` forward + backward passes (logit
    difference at each prompt's last token, w.r.t. the input embeddings)."""
    dev = next(hf.parameters()).device
    embed = hf.get_input_embeddings()
    for b in batches:
        tokens = b.tokens.to(dev)
        rows = torch.arange(len(tokens), device=dev)
        with torch.no_grad():
            for _ in range(forwards):
                hf(input_ids=tokens, use_cache=False)
        for _ in range(backwards):
            x = embed(tokens).detach().requires_grad_(True)
            logits = hf(inputs_embeds=x, use_cache=False).logits[rows, _last(b, dev)].float()
            good = logits.gather(1, b.answers[:, :1].to(dev)).squeeze(1)
            bad = logits.gather(1, b.wrong_answers[:, :1].to(dev)).squeeze(1)
            torch.autograd.grad((good - bad).sum(), [x])
    _sync(device)


def _timed(fn: Any, device: str) -> tuple[float, float]:
    with Peak(device) as peak:
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        seconds = time.perf_counter() - t
    return seconds, peak.mib


def _eap_ig(steps: int) -> Any:
    import entoscope as es

    return es.Circuits(method="eap_ig", steps=steps, faithfulness=[])


def _exact() -> Any:
    import entoscope as es

    return es.Patching(method="exact", sites=es.Sites(activation="resid_pre", over=["layer", "position"]))


def _batches(model: Any, data: Any, size: int) -> list[Any]:
    from entoscope.data.tokenized import make_batches, pad_id, tokenize_data
    from entoscope.models.adapter import adapt

    a = adapt(model)
    return make_batches(tokenize_data(a, data, pairs=True, answers=True), size, pad_id(a))


def _work(name: str, model: Any, data: Any, steps: int) -> tuple[Any, Any, list[Any], int, int]:
    """(operation, plan, floor batches, floor forwards per batch, floor forward+backwards per batch)."""
    from entoscope.models.adapter import adapt

    if name == "eap_ig":
        op = _eap_ig(steps)
        prepared = op.prepare_for(model, data)
        plan = op.plan(model, data)
        n = len(data)
        return op, plan, list(prepared.state.batches), (plan.forward_passes - plan.backward_passes) // n, \
            plan.backward_passes // n
    op = _exact()
    prepared = op.prepare_for(model, data)
    plan = op.plan(model, data)
    L = adapt(model).structure.n_layers
    positions = plan.rows // L  # one row per (layer, position)
    size = max(len(c) for c in prepared.state.chunks)
    equivalents = 2 + positions * (L + 1) / 2  # sum over layers l of (L - l) / L, per position
    return op, plan, _batches(model, data, size), math.ceil(equivalents), 0


def time_one(name: str, model: Any, model_name: str, dtype: str, device: str, data: Any, warm: Any,
             steps: int, budget_s: float, n_requested: int) -> Timing:
    """Warm up on `warm` (a few prompts), check the budget with one batch of the floor, then time the floor
    and the operation over `data` (cut to whole batches that fit `budget_s` where needed)."""
    hf = hf_module(model)
    op, _, wb, f, bwd = _work(name, model, warm, steps)
    op.run(model, warm, quiet=True)  # once-per-model checks, CUDA kernels and caches
    floor_passes(hf, wb[:1], f, bwd, device)
    one_s, _ = _timed(lambda: floor_passes(hf, wb[:1], f, bwd, device), device)
    per_prompt = one_s / len(wb[0].index)
    note = ""
    n = len(data)
    estimate = 3 * per_prompt * n  # the floor, and the operation at up to 2x the floor
    if estimate > budget_s:
        keep = max(len(wb[0].index), int(n * budget_s / estimate))
        note = f"cut from {n} to {keep} prompts to fit {budget_s:.0f} s (estimated {estimate:.0f} s)"
        print(f"  {name}: {note}", flush=True)
        data = dataclasses.replace(data, examples=data.examples[:keep])
        n = keep
    op, plan, batches, f, bwd = _work(name, model, data, steps)
    floor_s, floor_mib = _timed(lambda: floor_passes(hf, batches, f, bwd, device), device)
    op_s, op_mib = _timed(lambda: op.run(model, data, quiet=True), device)
    target = TARGETS[name]
    t = Timing(name, model_name, dtype, device, n, n_requested, op_s, floor_s, op_s / floor_s, op_s * 1000 / n,
               op_mib, floor_mib, plan.forward_passes, plan.backward_passes, f * n, bwd * n, target, note=note)
    if device.startswith("cuda"):
        t.meets = "yes" if t.per_1000_s <= target and t.ratio <= TARGET_RATIO else "no"
    return t
