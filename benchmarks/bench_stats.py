"""What the intervals cost: each operation run with `stats.n_boot=0` (no intervals) and with the
default (1000 BCa resamples), in the same script, on the demo model and (lens, DLA, head scores) a
GPT-2-small-sized random model. The interval time is the time spent in the statistics
(`entoscope.stats.bootstrap._summarise` and `_summarise_sums`, timed around every call: value, leave-one-out, the 1000
resamples, the interval, s.e. and p-values) during the default run; the ratio is interval time /
the run without intervals. The wall-clock difference of the two runs is printed too, but on a shared
machine it is within the noise. Each timing is the best of --repeats runs (model and data loaded once,
a warm-up run first). Threads: --threads (default 1).

    python benchmarks/bench_stats.py [--threads 1] [--repeats 3] [--quick] [--no-gpt2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, gpt2_small, random_prompts, set_threads  # noqa: E402



def cases(es, n: int):
    """(name, operation factory taking a Stats, data) on the demo model."""
    resid = es.Sites(activation="resid_pre", over=["layer", "position"])
    return [
        ("patching exact (resid_pre, layer x position)", lambda s: es.Patching(sites=resid, stats=s),
         {"task": "ioi", "n": n, "seed": 0}),
        ("patching attribution (z, layer x head x position)",
         lambda s: es.Patching(method="attribution", sites=es.Sites(activation="z", over=["layer", "head", "position"]),
                               stats=s), {"task": "ioi", "n": n, "seed": 0}),
        ("lens (resid_post, layer x position)", lambda s: es.Lens(stats=s), {"task": "ioi", "n": n, "seed": 0}),
        ("DLA (heads, MLPs)", lambda s: es.DirectLogitAttribution(stats=s), {"task": "ioi", "n": n, "seed": 0}),
        ("DLA with neurons (every layer)", lambda s: es.DirectLogitAttribution(neurons=True, stats=s),
         {"task": "ioi", "n": n, "seed": 0}),
        ("head scores (3 kinds)", lambda s: es.HeadScores(stats=s), {"task": "induction", "n": n, "seed": 0}),
        ("probing (resid_post by layer, 5-fold)", lambda s: es.Probing(split="kfold", k=5, stats=s),
         {"task": "ioi", "n": 4 * n, "seed": 0}),
        ("circuits EAP-IG (+ faithfulness curve)", lambda s: es.Circuits(method="eap_ig", stats=s),
         {"task": "ioi", "n": n, "seed": 0}),
    ]


def gpt2_cases(es, n: int):
    data = es.Dataset("random", tuple(es.Example(p) for p in random_prompts(n, 16)))
    repeated = es.Dataset("repeats", tuple(es.Example(p[:9] + p[1:9]) for p in random_prompts(n, 16, seed=1)))
    answered = es.Dataset("answers", tuple(es.Example(p[:-2], answers=(p[-2],), wrong_answers=(p[-1],))
                                           for p in random_prompts(n, 16, seed=2)))
    return [
        ("lens (12 layers x 15 positions)", lambda s: es.Lens(stats=s, batch_size=16), data),
        ("DLA (144 heads, 12 MLPs)", lambda s: es.DirectLogitAttribution(stats=s), answered),
        ("head scores (144 heads, 3 kinds)", lambda s: es.HeadScores(stats=s, period=8), repeated),
    ]


class StatsTimer:
    """Accumulates the time spent in entoscope.stats.bootstrap's two summaries (whole-matrix and block by
    block) while installed."""

    NAMES = ("_summarise", "_summarise_sums")

    def __enter__(self) -> StatsTimer:
        from entoscope.stats import bootstrap

        self.module, self.seconds = bootstrap, 0.0
        self.inner = {name: getattr(bootstrap, name) for name in self.NAMES}

        def timing(inner):
            def timed(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t
            return timed
        for name, inner in self.inner.items():
            setattr(bootstrap, name, timing(inner))
        return self

    def __exit__(self, *exc) -> None:
        for name, inner in self.inner.items():
            setattr(self.module, name, inner)


def measure(model, name, make, data, repeats: int, Stats) -> tuple[str, float, float, float]:
    make(Stats(n_boot=0)).run(model, data, quiet=True)  # warm-up
    base = best_of(lambda: make(Stats(n_boot=0)).run(model, data, quiet=True), repeats)
    full, in_stats = float("inf"), float("inf")
    for _ in range(repeats):
        with StatsTimer() as timer:
            t = time.perf_counter()
            make(Stats()).run(model, data, quiet=True)
            full = min(full, time.perf_counter() - t)
        in_stats = min(in_stats, timer.seconds)
    return name, base, full, in_stats


def report(title: str, rows) -> None:
    print(title)
    print(f"  {'operation':52s} {'n_boot=0':>9s} {'n_boot=1000':>12s} {'in stats':>9s} {'ratio':>7s} {'wall diff':>9s}")
    for name, base, full, in_stats in rows:
        print(f"  {name:52s} {base:8.3f}s {full:11.3f}s {in_stats:8.3f}s {100 * in_stats / base:6.1f}% "
              f"{100 * (full - base) / base:8.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="16 prompts (probing 64), 1 repeat, no GPT-2-sized model")
    ap.add_argument("--no-gpt2", action="store_true", help="skip the GPT-2-small-sized model")
    args = ap.parse_args()
    threads = set_threads(args.threads)
    import warnings

    import entoscope as es
    from entoscope.stats import Stats

    warnings.filterwarnings("ignore")
    n = 16 if args.quick else 48
    repeats = 1 if args.quick else args.repeats
    demo = es.load_model("demo")
    rows = [measure(demo, name, make, data, repeats, Stats) for name, make, data in cases(es, n)]
    report(f"demo model, {n} prompts (probing {4 * n}), {threads} thread(s), best of {repeats}; "
           "ratio = time in the statistics / run without intervals", rows)
    if not (args.quick or args.no_gpt2):
        model = gpt2_small()
        rows = [measure(model, name, make, data, repeats, Stats) for name, make, data in gpt2_cases(es, 32)]
        report(f"GPT-2-small-sized random model, 32 prompts x 16 tokens, {threads} thread(s), best of {repeats}", rows)


if __name__ == "__main__":
    main()
