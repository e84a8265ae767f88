"""Benchmark: the cost of the feature operations against their component (or patching) baselines.

    python benchmarks/bench_feature_ops.py            # 32 IOI prompts, 3 repeats
    python benchmarks/bench_feature_ops.py --quick    # 4 prompts, 1 repeat (a smoke run)

Model: the bundled demo model with its bundled dictionaries. Measured in this one process (threads set
and printed), the median of --repeat runs:
  (a) dla: component DLA (the baseline of (b));  (b) feature_dla over the three transcoders;
  (c) attribution patching over every feature of the three resid_post SAEs at the last 3 positions
      (the baseline of (d) and (e));
  (d) feature_graph, EAP, over the same SAEs (32 feature nodes per prompt, every position);
  (e) feature_graph, EAP-IG with 8 steps.
Reported: each time and the ratios (b)/(a), (d)/(c), (e)/(c).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.repeat = 4, 1
    torch.set_num_threads(args.threads)
    import entoscope as es

    model = es.load_model("demo")
    data = es.tasks.ioi(n=args.prompts, seed=3)
    sites = es.Sites(activation="resid_post", dictionary="demo", over=["layer", "position", "feature"],
                     positions=[-3, -2, -1])
    ops = {
        "(a) dla": es.DirectLogitAttribution(),
        "(b) feature_dla (transcoders)": es.FeatureDLA(dictionary="demo", activation="mlp_out"),
        "(c) attribution patching over features": es.Patching(method="attribution", sites=sites),
        "(d) feature_graph eap": es.FeatureGraph(max_features=32),
        "(e) feature_graph eap_ig, 8 steps": es.FeatureGraph(max_features=32, method="eap_ig", steps=8),
    }
    times: dict[str, list[float]] = {k: [] for k in ops}
    for op in ops.values():  # warm-up (vocabulary strings, first-call costs)
        op.run(model, es.tasks.ioi(n=2, seed=1), quiet=True)
    for _ in range(args.repeat):
        for name, op in ops.items():
            start = time.perf_counter()
            op.run(model, data, quiet=True)
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.prompts} IOI prompts, "
          f"median of {args.repeat}")
    for k, v in med.items():
        print(f"  {k:45s} {v:8.3f} s")
    a, b, c, d, e = med.values()
    print(f"  ratio (b)/(a) {b / a:.2f}   (d)/(c) {d / c:.2f}   (e)/(c) {e / c:.2f}")


if __name__ == "__main__":
    main()
