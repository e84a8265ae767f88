"""Every operation measured for memory and time: its config and data on a model, and one measurement of it in a
fresh process (`measure`), for bench_memory.py (plan vs measured, budgets, the cost table) and the tests.

A case is `build(ctx) -> (operation, data)`; ctx names the model's tokenizer, its vocabulary, the number of
prompts and the budget. `measure(model, dtype, case, ...)` runs the case in a child process (one thread):

1. loads the model (`demo`, a HuggingFace folder, or `shape:NAME` from shapes.py) in `dtype`;
2. makes the plan (`Operation.plan`: no forward), gives the heap back (heap.give_back_memory) and reads the
   process's resident set size: the base, "the loaded model" (weights, libraries, the plan's imports);
3. resets the peak (`/proc/self/clear_refs` 5: VmHWM := VmRSS), runs the operation, reads VmHWM: the
   measured peak above the loaded model is VmHWM - base;
4. optionally (floor=True) times the forwards and backwards the plan counts as plain model calls on the
   same prompts (`floor_seconds`), and one calibration forward (`Operation.calibrate`).
It returns a dict (plan's peak, measured peak, batch sizes, passes, CPU and wall seconds, or the refusal's
code and message when the operation was refused).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
STATS = {"n_boot": 200}
REAL = Path.home() / ".cache" / "entoscope" / "real-models"
MODELS = {"smollm2": str(REAL / "smollm2-135m"), "gemma3": str(REAL / "gemma3-270m")}


class Ctx:
    def __init__(self, adapter: Any, n: int, memory: Any, model_name: str) -> None:
        self.n, self.memory, self.model_name = n, memory, model_name
        self.tokenizer = None if model_name == "demo" else adapter.tokenizer
        self.vocab_size = min(adapter.structure.d_vocab, len(adapter.tokenizer))
        self.bos = adapter.bos_token_id
        self.n_layers = adapter.structure.n_layers


def _es() -> Any:
    import entoscope as es

    return es


def ioi(ctx: Ctx, n: int | None = None, seed: int = 1) -> Any:
    return _es().tasks.ioi(n=n or ctx.n, seed=seed, tokenizer=ctx.tokenizer)


def _common(ctx: Ctx) -> dict[str, Any]:
    return {"stats": STATS, "memory": ctx.memory}


def _lens(c: Ctx) -> Any:
    es = _es()
    return es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"]), **_common(c)), ioi(c)


def _probing(c: Ctx) -> Any:
    es = _es()
    return es.Probing(sites=es.Sites(activation="resid_post", over=["layer"]), split="kfold", k=3, C_grid=[1.0],
                      **_common(c)), ioi(c, n=max(c.n, 12))


def _exact(c: Ctx) -> Any:
    es = _es()
    return es.Patching(method="exact", sites=es.Sites(activation="resid_pre", over=["layer"]), **_common(c)), ioi(c)


def _attribution(c: Ctx) -> Any:
    es = _es()
    return es.Patching(method="attribution", sites=es.Sites(activation="z", over=["layer", "head"]),
                       **_common(c)), ioi(c)


def _ig(c: Ctx) -> Any:
    es = _es()
    layers = sorted({0, c.n_layers // 2, c.n_layers - 1})
    return es.Patching(method="integrated_gradients", ig_steps=4, sites=es.Sites(
        activation="attn_out", over=["layer"], layers=layers), **_common(c)), ioi(c)


def _dla(c: Ctx) -> Any:
    return _es().DirectLogitAttribution(**_common(c)), ioi(c)


def _head_scores(c: Ctx) -> Any:
    es = _es()
    return es.HeadScores(**_common(c)), es.tasks.repeated_tokens(n=c.n, seed=1, vocab_size=c.vocab_size, length=10,
                                                                 bos_token_id=c.bos)


def _ifr(c: Ctx) -> Any:
    return _es().InformationFlowRoutes(**_common(c)), ioi(c)


def _eap(c: Ctx) -> Any:
    return _es().Circuits(method="eap", n_edges=20, faithfulness=[0.01, 0.1, 0.5], **_common(c)), ioi(c)


def _eap_ig(c: Ctx) -> Any:
    return _es().Circuits(method="eap_ig", steps=3, n_edges=20, faithfulness=[0.01, 0.1, 0.5], **_common(c)), ioi(c)


def _steering(c: Ctx) -> Any:
    es = _es()
    layer = c.n_layers // 2
    return es.Steering(direction={"source": "mean_difference", "site": f"resid_pre.{layer}",
                                  "data": {"task": "ioi", "n": c.n, "seed": 2}},
                       coefficients=[0.5, 1.0], side_effects=None, **_common(c)), ioi(c)


def _interchange(c: Ctx) -> Any:
    es = _es()
    L = c.n_layers
    return es.Interchange(layers=[L // 3, 2 * L // 3], positions=["S2", "END"], bases=["das", "pca"], rank=4,
                          epochs=2, **_common(c)), ioi(c, n=max(c.n, 8))


def _jacobian_fit(c: Ctx) -> Any:
    es = _es()
    L = c.n_layers
    return es.JacobianLensFit(layers=[L // 2], skip_first=4, max_length=24, memory=c.memory), \
        es.tasks.repeated_tokens(n=min(c.n, 4), seed=1, vocab_size=c.vocab_size, length=12, bos_token_id=c.bos)


CASES: dict[str, Callable[[Ctx], Any]] = {
    "lens": _lens, "probing": _probing, "patching.exact": _exact, "patching.attribution": _attribution,
    "patching.ig": _ig, "dla": _dla, "head_scores": _head_scores, "ifr": _ifr, "circuits.eap": _eap,
    "circuits.eap_ig": _eap_ig, "steering": _steering, "interchange": _interchange, "jacobian_fit": _jacobian_fit,
}


# ---------------------------------------------------------------------------------------------- the child
def load(name: str, dtype: str) -> Any:
    es = _es()
    if name.startswith("shape:"):
        sys.path.insert(0, str(HERE))
        from shapes import build

        return build(name.split(":", 1)[1], dtype)
    return es.load_model(MODELS.get(name, name), dtype=dtype)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def floor_seconds(model: Any, prompts: list[list[int]], forwards: int, backwards: int, batch: int) -> dict[str, float]:
    """CPU seconds of the plan's passes as plain model calls: a forward per prompt (batches of `batch` prompts of
    these lengths, no gradients) times `forwards`, plus (forward + backward of a prompt - its forward) times
    `backwards` (the backward to the activations from the embedding's output on, the weights frozen, as the
    operations run theirs); the per-prompt costs measured here on the first `batch` prompts."""
    import time

    import torch

    from entoscope.models.adapter import adapt

    a = adapt(model)
    rows = prompts[:max(1, batch)]
    T = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows], device=a.device)
    module = a.module
    with torch.no_grad():
        module(tokens)  # warm-up
        c0 = time.process_time()
        module(tokens)
        fwd = (time.process_time() - c0) / len(rows)
    both = 0.0
    if backwards:  # as the operations' backwards: to the activations, the weights frozen (no weight gradients,
        # which on the 2B shape in float32 would take another 10 GB)
        embedding = next(m for m in module.modules() if isinstance(m, torch.nn.Embedding))
        hook = embedding.register_forward_hook(lambda m, i, o: o.detach().requires_grad_(True))
        flags = [p.requires_grad for p in module.parameters()]
        for p in module.parameters():
            p.requires_grad_(False)
        try:
            c0 = time.process_time()
            out = module(tokens)
            out[:, -1].float().logsumexp(-1).sum().backward()
            both = (time.process_time() - c0) / len(rows)
        finally:
            hook.remove()
            for p, flag in zip(module.parameters(), flags):
                p.requires_grad_(flag)
    return {"forward_s": fwd, "forward_backward_s": both,
            "floor_s": fwd * forwards + max(0.0, both - fwd) * backwards}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import time

    import torch

    torch.set_num_threads(1)
    from entoscope.errors import EntoscopeError
    from entoscope.heap import give_back_memory
    from entoscope.models.adapter import adapt

    model = load(spec["model"], spec["dtype"])
    a = adapt(model)
    ctx = Ctx(a, spec["n"], spec.get("memory", "auto"), spec["model"])
    op, data = CASES[spec["case"]](ctx)
    out: dict[str, Any] = {"case": spec["case"], "model": spec["model"], "dtype": spec["dtype"], "n": spec["n"],
                           "memory": spec.get("memory"), "model_bytes": sum(p.numel() * p.element_size()
                                                                            for p in a.module.parameters())}
    try:
        plan = op.plan(model, data)
    except EntoscopeError as err:
        out.update(refused=err.code, message=err.one_line())
        return out
    out.update(plan_peak=plan.peak_memory_bytes, batch_sizes=plan.batch_sizes, forward=plan.forward_passes,
               backward=plan.backward_passes, budget=getattr(plan, "memory_budget_bytes", None))
    if spec.get("calibrate") and hasattr(op, "calibrate"):
        plan = op.calibrate(model, data)
        out["estimate_s"] = plan.seconds
    give_back_memory()
    base = _status("VmRSS")
    _reset_peak()
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        op.run(model, data, quiet=True)
    except EntoscopeError as err:
        out.update(refused=err.code, message=err.one_line())
        return out
    out.update(measured=_status("VmHWM") - base, cpu_s=time.process_time() - c0, wall_s=time.perf_counter() - t0,
               base=base)
    if spec.get("floor"):
        from entoscope.data.tokenized import tokenize_data

        td = tokenize_data(a, data, prepend_bos=True) if data is not None else None
        prompts = [list(p) for p in td.prompts] if td is not None else [[0] * 8]
        out.update(floor_seconds(model, prompts, plan.forward_passes, plan.backward_passes,
                                 max(plan.batch_sizes or [1])))
    return out


def measure(model: str, dtype: str, case: str, *, n: int = 16, memory: Any = "auto", floor: bool = False,
            calibrate: bool = False, timeout: float = 3600) -> dict[str, Any]:
    """One case in a fresh process (module docstring): its dict, or {"error": the child's last lines}."""
    spec = {"model": model, "dtype": dtype, "case": case, "n": n, "memory": memory, "floor": floor,
            "calibrate": calibrate}
    env = dict(os.environ, ENTOSCOPE_QUIET="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"case": case, "model": model, "dtype": dtype, "error": (proc.stderr or proc.stdout)[-2000:]}


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    print("RESULT " + json.dumps(child(json.loads(sys.argv[1]))), flush=True)
