"""Benchmark: attribution patching over every feature of the demo dictionaries vs one exact patch per feature.

    python benchmarks/bench_feature_patching.py                 # 16 IOI pairs, 3 positions, 3 layers x 512 features
    python benchmarks/bench_feature_patching.py --quick         # 4 pairs, 1 position, one layer (a smoke run)

Model: the bundled demo model (TransformerBridge, 3 layers, d_model 128) with its bundled top-k SAEs on
resid_post of each layer (512 features each). Sites: every feature at the last --positions positions of
every layer (3 x 3 x 512 = 4608 sites by default), denoising, logit difference.
Compared in this one process, thread count set and printed:
  (a) exact patching: one patched forward per (prompt, feature site), batched (the baseline);
  (b) attribution patching: one forward with gradients, one backward and one source forward per batch
      of prompts, for all sites at once.
Reported: the median time of --repeat runs of each and their ratio (a / b), and how well (b) ranks the
features (a) finds: Pearson correlation of the per-(prompt, site) differences, and the mean share of
each prompt's top-10 sites by |exact| that are also in its top-10 by |attribution|.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--positions", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.pairs, args.positions, args.repeat = 4, 1, 1
    torch.set_num_threads(args.threads)
    import entoscope as es

    model = es.load_model("demo")
    data = es.tasks.ioi(n=args.pairs)
    sites = es.Sites(activation="resid_post", dictionary="demo", over=["layer", "position", "feature"],
                     positions=list(range(-args.positions, 0)), layers=[1] if args.quick else "all")
    ops = {"exact": es.Patching(method="exact", sites=sites, comparison="difference"),
           "attribution": es.Patching(method="attribution", sites=sites, comparison="difference")}
    times: dict[str, list[float]] = {k: [] for k in ops}
    results = {}
    for _ in range(args.repeat):
        for name, op in ops.items():
            start = time.perf_counter()
            results[name] = op.run(model, data, quiet=True)
            times[name].append(time.perf_counter() - start)
    units = len(results["exact"].table)
    diff = {k: (r.extra["patched"] - r.extra["m_base"][:, None]).numpy() for k, r in results.items()}
    corr = float(np.corrcoef(diff["exact"].ravel(), diff["attribution"].ravel())[0, 1])
    k = 10
    top_e = np.argsort(-np.abs(diff["exact"]), axis=1)[:, :k]
    top_a = np.argsort(-np.abs(diff["attribution"]), axis=1)[:, :k]
    overlap = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(top_e, top_a)]))
    med = {kk: statistics.median(v) for kk, v in times.items()}
    print(f"threads {torch.get_num_threads()}, {args.pairs} IOI pairs, {units} feature sites per prompt")
    print(f"(a) exact, one patch per feature site: {med['exact']:.2f} s   (median of {args.repeat})")
    print(f"(b) attribution over all feature sites: {med['attribution']:.2f} s")
    print(f"ratio (a)/(b): {med['exact'] / med['attribution']:.1f}x")
    print(f"agreement: Pearson r {corr:.3f} over {diff['exact'].size} (prompt, site) differences; "
          f"top-{k} overlap per prompt {overlap:.0%}")


if __name__ == "__main__":
    main()
