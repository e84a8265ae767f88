"""Benchmark: the probing operation (batched collection + batched probes) against one forward per prompt.

Setup: a GPT-2-small-sized random model (12 layers, d_model 768, built offline), 200 prompts of
24..48 random tokens, random binary labels; one probe per layer on resid_post at each prompt's
last token (12 sites), the default C grid (7 values) chosen on validation rows, held-out scores,
and the shuffled-label control.

  entoscope    Probing(...).run(model, data): right-padded batches through ModelAdapter.run (only the
               12 activations read), fit_probes (all sites and the control in batched torch solvers)
  anchor       the usual hand-written loop: model.run_with_cache(tokens) per prompt (every hook cached),
               then per site StandardScaler + LogisticRegression for each C, choice on validation rows,
               test scores, and the same for shuffled labels (sklearn, default tol)
  anchor, filtered   the same loop with run_with_cache(names_filter=the 12 hooks): a more careful
               baseline, to show how much of the gain is batching rather than caching less
Both sides use the same rows for train / validation / test and report the same held-out accuracies
(the script prints the largest difference). Threads are set explicitly (torch and BLAS).

Usage: python benchmarks/bench_probing.py [--threads 1] [--repeats 1] [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gpt2_small, random_prompts, set_threads  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_data(n: int, seed: int = 0):
    from entoscope.data import Dataset, Example

    rng = random.Random(seed)
    prompts = random_prompts(n, 48, seed=seed)
    labels = [i % 2 for i in range(n)]
    rng.shuffle(labels)
    return Dataset("random", tuple(Example(p[: rng.randint(24, 48)], label=y) for p, y in zip(prompts, labels)))


def anchor(model, data, sp, grid, *, filtered: bool, device: str):
    """One forward per prompt, then a sklearn loop over sites. Returns (collect s, fit s, test accuracies [S])."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score
    from sklearn.preprocessing import StandardScaler

    from entoscope.probing.controls import shuffled_labels

    L = model.cfg.n_layers
    hooks = [f"blocks.{layer}.hook_resid_post" for layer in range(L)]
    t0 = time.perf_counter()
    X = np.zeros((L, len(data), model.cfg.d_model), dtype=np.float32)
    with torch.no_grad():
        for i, e in enumerate(data):
            tokens = torch.tensor([list(e.prompt)], device=device)
            _, cache = model.run_with_cache(tokens, names_filter=hooks) if filtered else model.run_with_cache(tokens)
            for layer, h in enumerate(hooks):
                X[layer, i] = cache[h][0, -1].float().cpu().numpy()
    t1 = time.perf_counter()
    y = np.array([e.label for e in data])
    yc = shuffled_labels(torch.tensor(y), seed=0).numpy()
    tr, va, te = sp.train.numpy(), sp.val.numpy(), sp.test.numpy()
    acc = []
    for s in range(L):
        sc = StandardScaler().fit(X[s, tr].astype(np.float64))
        Z = {k: sc.transform(X[s, idx].astype(np.float64)) for k, idx in (("tr", tr), ("va", va), ("te", te))}
        for labels in (y, yc):
            best, best_acc = None, -1.0
            for c in grid:
                m = LogisticRegression(C=c, max_iter=10_000).fit(Z["tr"], labels[tr])
                a = accuracy_score(labels[va], m.predict(Z["va"]))
                if a > best_acc:
                    best, best_acc = m, a
            if labels is y:
                acc.append(accuracy_score(labels[te], best.predict(Z["te"])))
    return t1 - t0, time.perf_counter() - t1, np.array(acc)


def ours(model, data, device: str):
    import entoscope as es
    from entoscope.probing import Probing

    op = Probing(sites=es.Sites(activation="resid_post"), lens_top_k=0, per_prompt=False, batch_size=32,
                 fit_device=device)
    t0 = time.perf_counter()
    result = op.run(model, data, quiet=True)
    total = time.perf_counter() - t0
    return total, result


def ours_parts(model, data, sp, grid, device: str):
    """The same work in two timed steps: collect_activations, then fit_probes (the breakdown)."""
    from entoscope.probing import collect_activations, fit_probes

    t0 = time.perf_counter()
    X = collect_activations(model, data, {"activation": "resid_post"}, batch_size=32).stacked()
    t1 = time.perf_counter()
    fit_probes(X, [e.label for e in data], split=sp, C_grid=grid, device=device)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1, help="torch and BLAS threads (default 1)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="40 prompts: a smoke run")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits

    set_threads(args.threads)
    threadpool_limits(args.threads)
    warnings.filterwarnings("ignore")
    from entoscope.probing import DEFAULT_C_GRID, holdout_split

    n = 40 if args.quick else 200
    model = gpt2_small()
    if args.device != "cpu":
        model = model.to(args.device)
    data = make_data(n)
    sp = holdout_split(torch.tensor([e.label for e in data]), seed=0)
    grid = list(DEFAULT_C_GRID)
    print(f"{n} prompts of 24..48 tokens, {model.cfg.n_layers} sites (resid_post, last token), d_model "
          f"{model.cfg.d_model}, {len(grid)} C values + shuffled control; device {args.device}; "
          f"torch threads = BLAS threads = {args.threads}; torch {torch.__version__}; wall clock, best of "
          f"{args.repeats}")
    ours(model, data[:8], args.device)  # warm-up (first-call costs on both sides)
    best = {"ours": float("inf"), "parts": (float("inf"),) * 2, "anchor": (float("inf"),) * 2,
            "filtered": (float("inf"),) * 2}
    acc_ours = acc_anchor = None
    for _ in range(args.repeats):  # interleaved: a change of load hits every side alike
        t, result = ours(model, data, args.device)
        best["ours"] = min(best["ours"], t)
        acc_ours = result.table["test_accuracy"].to_numpy()
        best["parts"] = min(best["parts"], ours_parts(model, data, sp, grid, args.device), key=sum)
        c, f, acc_anchor = anchor(model, data, sp, grid, filtered=False, device=args.device)
        best["anchor"] = min(best["anchor"], (c, f), key=sum)
        c, f, _ = anchor(model, data, sp, grid, filtered=True, device=args.device)
        best["filtered"] = min(best["filtered"], (c, f), key=sum)
    o = best["ours"]
    print(f"  entoscope Probing.run (collect + fit):   {o:7.2f} s  (separately: collect {best['parts'][0]:6.2f} s, "
          f"fit_probes {best['parts'][1]:6.2f} s)")
    for name, label in (("anchor", "anchor: run_with_cache per prompt"), ("filtered", "anchor, names_filter")):
        c, f = best[name]
        print(f"  {label:38s} {c + f:7.2f} s  (forwards {c:6.2f} s, sklearn {f:6.2f} s)   ratio {(c + f) / o:5.1f}x")
    print(f"  held-out accuracy, entoscope vs sklearn: max |diff| = {np.abs(acc_ours - acc_anchor).max():.3g} "
          f"over {len(acc_ours)} sites (random labels: both near 0.5)")


if __name__ == "__main__":
    main()
