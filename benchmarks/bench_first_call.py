"""Benchmark of the first call on a model against a warm call, for each operation.

    python benchmarks/bench_first_call.py                 # every operation, a model entoscope has not seen
    python benchmarks/bench_first_call.py --loaded        # the model as entoscope.load_model/from_hf gives it
    python benchmarks/bench_first_call.py --only ifr lens

Model: GPT-2 small's shape (12 layers, 12 heads, d_model 768, vocabulary 50257), random weights, built
offline as a TransformerBridge (benchmarks/common.py). Each operation runs in its own fresh process,
1 torch thread: the model is built, the operation's module imported (timed apart: "import"), then the
operation is called once ("first") and --repeat more times ("warm": the median). A first call pays the
one-time checks of the model (finite weights, describability: models/guards.py, once per weights version)
and whatever the run imports lazily; the manifest's fingerprint is hashed when the manifest is first read
or saved (models/fingerprint.py), not in the call. By default the model is one entoscope has not seen (its
load-time checks forgotten, as for a bridge a user built with TransformerLens); with --loaded the checks
ran at load, as for entoscope.load_model. Wall and CPU time (this process's) are both printed.

Baseline ("forward"): the bridge's own forward of the same 24-token prompt, no entoscope, first call at
that shape vs warm: what torch and the bridge pay once per process and shape whatever runs on top (the
model's load-time checks ran at a 4-token shape).
Calls: one prompt of 24 random tokens for lens, DLA, head scores (a repeated random sequence) and IFR (tau
0.04); one pair of 15 tokens for exact patching (resid_pre, layer x position) and EAP-IG circuits (5 steps);
probing: 48 prompts of 12 tokens, resid_post of every layer, a binary label. Target: IFR's first call on
one prompt within 1.5x of a warm call.

Last line (not with --loaded): the one-time checks timed alone, each against a warm IFR call in the same
process (checks_child).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPERATIONS = ["forward", "lens", "patching", "dla", "head_scores", "ifr", "circuits", "probing"]


def _operation(name: str):
    """(operation, data) of one benchmark call."""
    import entoscope as es
    from entoscope.data import Dataset, Example

    from common import random_prompts

    def pairs(n: int, length: int) -> Dataset:
        clean, corrupt = random_prompts(n, length, seed=1), random_prompts(n, length, seed=2)
        return Dataset("bench", tuple(Example(c, k, answers=(11,), wrong_answers=(17,)) for c, k in zip(clean, corrupt)))

    one = Dataset("bench", tuple(Example(p, answers=(11,), wrong_answers=(17,)) for p in random_prompts(1, 24)))
    if name == "lens":
        return es.Lens(), one
    if name == "patching":
        return es.Patching(sites=es.Sites(activation="resid_pre", over=["layer", "position"])), pairs(1, 15)
    if name == "dla":
        return es.DirectLogitAttribution(), one
    if name == "head_scores":
        half = random_prompts(1, 13)[0]
        return es.HeadScores(period=12), Dataset("bench", (Example(half + half[1:]),))
    if name == "ifr":
        return es.InformationFlowRoutes(tau=0.04, drawn_routes=0), one
    if name == "circuits":
        return es.Circuits(method="eap_ig", steps=5, faithfulness=[]), pairs(1, 15)
    if name == "probing":
        prompts = random_prompts(48, 12, seed=3)
        data = Dataset("bench", tuple(Example(p, label=int(p[1] % 2)) for p in prompts))
        return es.Probing(), data
    raise SystemExit(f"unknown operation {name}")


STAMPS = ("_entoscope_finite_stamp", "_entoscope_describable", "_entoscope_unembeds")


def checks_child(repeat: int) -> dict:
    """The one-time checks alone against a warm IFR call on the same model, in one process: the finite
    scan, the block-0 describability forward (both in `adapt`) and the unembedding check as a first
    forward makes it (on that forward's own last residual and logits), each made again with the stamps
    forgotten; the median of `repeat`."""
    sys.path.insert(0, str(HERE))
    import torch

    from common import gpt2_small, set_threads
    from entoscope.models.adapter import ModelAdapter
    from entoscope.models.guards import check_describable, check_finite_weights, check_unembedding

    set_threads(1)
    model = gpt2_small("bridge")
    op, data = _operation("ifr")
    op.run(model, data, quiet=True)
    adapter = ModelAdapter(model)
    final = f"resid_post.{adapter.structure.n_layers - 1}"
    out = adapter.run(torch.tensor([data.examples[0].prompt]), [final])  # the prompt is token ids
    witness = (out[final][0, -4:], out.logits[0, -4:])

    def cpu(fn) -> float:
        times = []
        for _ in range(repeat):
            for key in STAMPS:
                model.__dict__.pop(key, None)
            c = time.process_time()
            fn()
            times.append(time.process_time() - c)
        return statistics.median(times)

    # the scan's floor: one sum over a single flat tensor holding as many bytes as the weights' storages
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    flat = torch.randn(sum(storages.values()) // 4)
    times = {"read_floor": cpu(lambda: flat.sum().item()),
             "scan": cpu(lambda: check_finite_weights(model)), "block0": cpu(lambda: check_describable(adapter)),
             "unembedding": cpu(lambda: check_unembedding(adapter, *witness))}
    warm = []
    for _ in range(repeat):
        c = time.process_time()
        op.run(model, data, quiet=True)
        warm.append(time.process_time() - c)
    return {**times, "warm_ifr": statistics.median(warm)}


def child(name: str, repeat: int, loaded: bool) -> dict:
    """Run in a fresh process: the timings of one operation."""
    sys.path.insert(0, str(HERE))
    from common import gpt2_small, random_prompts, set_threads

    set_threads(1)
    model = gpt2_small("bridge")
    if not loaded:  # forget the load-time checks: a bridge entoscope has not seen
        for key in STAMPS:
            model.__dict__.pop(key, None)
    t, c = time.perf_counter(), time.process_time()
    if name == "forward":  # the baseline: torch's own first forward at this shape vs a warm one, no entoscope
        import torch

        tokens = torch.tensor([random_prompts(1, 24)[0]])

        def call() -> None:
            with torch.no_grad():
                model(tokens)
    else:
        op, data = _operation(name)

        def call() -> None:
            op.run(model, data, quiet=True)
    imported = (time.perf_counter() - t, time.process_time() - c)
    runs = []
    for _ in range(1 + repeat):
        t, c = time.perf_counter(), time.process_time()
        call()
        runs.append((time.perf_counter() - t, time.process_time() - c))
    warm = (statistics.median(r[0] for r in runs[1:]), statistics.median(r[1] for r in runs[1:]))
    return {"import": imported, "first": runs[0], "warm": warm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=OPERATIONS, choices=OPERATIONS)
    ap.add_argument("--repeat", type=int, default=3, help="warm calls (the median is kept)")
    ap.add_argument("--loaded", action="store_true", help="the model as load_model gives it (checks done at load)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "checks":
        print(json.dumps(checks_child(max(args.repeat, 5))))
        return
    if args.child:
        print(json.dumps(child(args.child, args.repeat, args.loaded)))
        return
    seen = "loaded by entoscope (checks at load)" if args.loaded else "not seen by entoscope (checks in the first call)"
    print(f"GPT-2-small-sized random bridge, 1 thread; model {seen}; warm = median of {args.repeat}")
    print(f"{'operation':<12} {'import wall/cpu':>16} {'first wall/cpu':>16} {'warm wall/cpu':>16} "
          f"{'first/warm wall':>16} {'first/warm cpu':>15}")
    for name in args.only:
        cmd = [sys.executable, __file__, "--child", name, "--repeat", str(args.repeat)] + (["--loaded"] * args.loaded)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        (iw, ic), (fw, fc), (ww, wc) = r["import"], r["first"], r["warm"]
        print(f"{name:<12} {iw:7.2f}s/{ic:6.2f}s {fw:7.2f}s/{fc:6.2f}s {ww:7.2f}s/{wc:6.2f}s {fw / ww:15.2f}x "
              f"{fc / wc:14.2f}x", flush=True)
    if args.loaded:
        return
    proc = subprocess.run([sys.executable, __file__, "--child", "checks", "--repeat", str(args.repeat)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"checks failed:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    total = r["scan"] + r["block0"] + r["unembedding"]
    print(f"one-time checks, CPU time against a warm IFR call ({r['warm_ifr']:.3f} s): finite scan {r['scan']:.3f} s "
          f"({r['scan'] / r['warm_ifr']:.0%}; {r['scan'] / r['read_floor']:.2f}x one sum over a flat tensor of the "
          f"same bytes, {r['read_floor']:.3f} s), block-0 describability forward {r['block0']:.3f} s "
          f"({r['block0'] / r['warm_ifr']:.0%}), unembedding check on the first forward's own numbers "
          f"{r['unembedding']:.4f} s ({r['unembedding'] / r['warm_ifr']:.1%}); together {total:.3f} s "
          f"({total / r['warm_ifr']:.0%})")


if __name__ == "__main__":
    main()
