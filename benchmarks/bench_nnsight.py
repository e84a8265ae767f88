"""What the nnsight backend costs against the plain TransformerBridge on the same weights (the demo model).

Three measurements, each reported as a ratio (nnsight time / bridge time, and multi-invoke / one batch):
  1. reads: a logit lens over every layer's resid_post (one cached-read run per batch)
  2. exact patching of resid_pre over layer x position (the bridge reuses the unpatched prefix; an nnsight
     model runs every patched run as a full forward)
  3. nnsight's multi-invoke batching: one trace with one `tracer.invoke` per prompt against one trace of the
     padded batch (what entoscope runs), reading every layer's resid_post

    python benchmarks/bench_nnsight.py [--prompts 16] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import entoscope as es

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bridge, nn = es.load_model("demo"), es.load_model("demo", backend="nnsight")
    data = es.tasks.ioi(n=args.prompts)
    lens = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"]))
    patching = es.Patching(method="exact", sites=es.Sites(activation="resid_pre", over=["layer", "position"]))
    for what, op in (("logit lens", lens), ("exact patching", patching)):
        tb = best_of(lambda op=op: op.run(bridge, data, quiet=True), args.repeats)
        tn = best_of(lambda op=op: op.run(nn, data, quiet=True), args.repeats)
        print(f"{what:16s} bridge {tb:7.3f} s  nnsight {tn:7.3f} s  ratio nnsight/bridge {tn / tb:5.2f}")

    adapter = es.models.adapt(nn)
    prompts = [adapter.tokenize(e.prompt) for e in data]
    T = min(map(len, prompts))
    batch = torch.tensor([q[:T] for q in prompts])
    blocks = nn.transformer.h

    def one_trace() -> None:
        kept: list = []
        with torch.no_grad(), nn.trace(batch):
            kept.extend(b.output.save() for b in blocks)
        assert len(kept) == len(blocks)

    def multi_invoke() -> None:
        kept = []
        with torch.no_grad(), nn.trace() as tracer:
            for row in batch:
                with tracer.invoke(row[None]):
                    kept.extend(b.output.save() for b in blocks)
        assert len(kept) == len(batch) * len(blocks)

    t1, tm = best_of(one_trace, args.repeats), best_of(multi_invoke, args.repeats)
    print(f"multi-invoke     one batch {t1:7.3f} s  one invoke per prompt {tm:7.3f} s  ratio {tm / t1:5.2f}")


if __name__ == "__main__":
    main()
