"""Logit lens over all layers x positions for 64 prompts on a GPT-2-small-sized random model,
against a plain TransformerLens loop (run_with_cache + accumulated_resid(apply_ln=True) + W_U per
prompt) in the same script. Threads: --threads (default 1; two busy threads on a shared 2-core machine
are erratic), set for torch before anything runs.

    python benchmarks/bench_lens.py [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import gpt2_small, measured, random_prompts, set_threads  # noqa: E402

import torch  # noqa: E402


def tl_loop(model, prompts, k):
    """The plain TransformerLens way: one prompt at a time."""
    out = []
    for p in prompts:
        tokens = torch.tensor([p])
        with torch.no_grad():
            logits, cache = model.run_with_cache(tokens)
            acc = cache.accumulated_resid(layer=-1, incl_mid=False, apply_ln=True)[1:]  # resid_post of each layer
            lens = acc @ model.W_U + model.b_U  # [L, 1, T, V]
            logp = lens.log_softmax(-1)
            final = logits.log_softmax(-1)
            kl = (final.exp() * (final - logp)).sum(-1)
            out.append((logp.exp().topk(k, dim=-1), kl))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8 prompts instead of 64")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    threads = set_threads(args.threads)
    import entoscope as es

    n = 8 if args.quick else 64
    model = gpt2_small()
    prompts = random_prompts(n, 15)
    data = es.Dataset("random", tuple(es.Example(p) for p in prompts))
    op = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"]), top_k=5, batch_size=16)
    op.run(model, data[:2], quiet=True)  # warm-up (vocabulary strings, allocator)
    tl_loop(model, prompts[:2], 5)
    tl_s, tl_mem = measured(tl_loop, model, prompts, 5)
    es_s, es_mem = measured(lambda: op.run(model, data, quiet=True))
    print(f"logit lens, {n} prompts x 15 tokens x 12 layers, GPT-2-small-sized random model, {threads} threads")
    print(f"  TransformerLens loop   {tl_s:.2f} s   peak memory above the loaded model {tl_mem:.0f} MiB")
    print(f"  entoscope Lens         {es_s:.2f} s   peak memory above the loaded model {es_mem:.0f} MiB")
    print(f"  ratio (TL loop time / entoscope time): {tl_s / es_s:.2f}x")


if __name__ == "__main__":
    main()
