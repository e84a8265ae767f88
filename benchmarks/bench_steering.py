"""Benchmark of steering: entoscope's batched dose-response against a loop of hooked forwards.

    python benchmarks/bench_steering.py                 # TransformerBridge, 1 thread
    python benchmarks/bench_steering.py --quick         # 4 prompts, 2 coefficients: a smoke run

Model: a random GPT-2-small-sized model (12 layers, d_model 768, 50257-token vocabulary) built offline, as a
TransformerBridge (benchmarks/common.py). Prompts: 15 random tokens (BOS first); metric: logit difference of
two fixed tokens at the last position. A random direction of norm 20 is added at resid_pre.6 at every
position, at K coefficients, with the random baseline of the same norm (2K conditions per prompt).

Compared, in this one process, on one intra-op thread (the same work both ways: per prompt the unsteered
run and 2K steered ones, the metric at the last token and KL(steered || unsteered) averaged over positions):
  (a) a loop: per prompt one plain forward, then per condition one run_with_hooks whose hook adds c * v;
  (b) es.Steering(...).run: the unsteered runs batched by length, the (prompt x condition) rows batched into
      forwards, plus the bootstrap intervals of its table (1,000 resamples).
Reported: CPU time (process_time: less distorted by other jobs than wall time) and wall time of each, the
ratio (a) / (b), and the largest difference between the two per-prompt metrics and KLs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import gpt2_small, random_prompts, set_threads  # noqa: E402


def loop(model, prompts, hook, vectors, coefficients):
    """(a): one forward per prompt, then one hooked forward per (prompt, condition)."""
    import torch

    metric, kl = [], []
    with torch.no_grad():
        for p in prompts:
            tokens = torch.tensor([p])
            clean = model(tokens)[0]
            lu = clean.float().log_softmax(-1)
            for v in vectors:
                for c in coefficients:
                    logits = model.run_with_hooks(tokens, fwd_hooks=[(hook, lambda x, hook, c=c, v=v: x + c * v)])[0]
                    ls = logits.float().log_softmax(-1)
                    metric.append(float(logits[-1, 3] - logits[-1, 4]))
                    kl.append(float((ls.exp() * (ls - lu)).sum(-1).double().mean()))
    return metric, kl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--coefficients", type=int, default=4, help="K: the dose-response's length")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.coefficients = 4, 2
    import numpy as np
    import torch
    from importlib.metadata import version

    import entoscope as es

    set_threads(args.threads)
    model = gpt2_small("bridge")
    prompts = random_prompts(args.prompts, 15, seed=1)
    data = es.Dataset("random", tuple(es.Example(p, answers=(3,), wrong_answers=(4,)) for p in prompts))
    v = torch.randn(768, generator=torch.Generator().manual_seed(0))
    direction = es.Direction("resid_pre.6", v / v.norm() * 20)
    coefficients = [0.25 * 2 ** k for k in range(args.coefficients)]
    op = es.Steering(direction=direction, coefficients=coefficients, side_effects=None, seed=0)
    random = direction.random_like(op.seed)

    t0, c0 = time.perf_counter(), time.process_time()
    result = op.run(model, data, quiet=True)
    wall_b, cpu_b = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    metric, kl = loop(model, prompts, "blocks.6.hook_resid_pre", [direction.vector, random.vector], coefficients)
    wall_a, cpu_a = time.perf_counter() - t0, time.process_time() - c0

    pp = result.per_prompt.sort_values(["example", "direction", "coefficient"])  # direction rows before random
    ours_m = pp.metric.to_numpy()
    ours_kl = pp.kl.to_numpy()
    diff_m = float(np.abs(ours_m - np.array(metric)).max())
    diff_kl = float(np.abs(ours_kl - np.array(kl)).max())
    rows = args.prompts * 2 * len(coefficients)
    print(f"torch {torch.__version__}, transformer-lens {version('transformer-lens')}, {args.threads} intra-op "
          f"thread(s), {os.cpu_count()} cores; GPT-2-small-sized bridge, {args.prompts} prompts x 15 tokens, "
          f"K = {len(coefficients)} coefficients (+ random baseline): {rows} steered rows")
    print(f"{'method':52s} {'cpu':>8s} {'wall':>8s} {'vs (a), cpu':>12s}")
    print(f"{'(a) loop: one run_with_hooks per (prompt, condition)':52s} {cpu_a:7.2f}s {wall_a:7.2f}s {1.0:11.2f}x")
    print(f"{'(b) es.Steering (batched, with intervals)':52s} {cpu_b:7.2f}s {wall_b:7.2f}s {cpu_a / cpu_b:11.2f}x")
    print(f"max |metric diff| {diff_m:.2e}, max |KL diff| {diff_kl:.2e}")


if __name__ == "__main__":
    main()
