"""What the sign-flip refinement and the confirmation stage cost (docs/statistics.md): exact patching of every
head's output (z, layer x head: 270 heads for SmolLM2-135M's 30 layers x 9 heads) over IOI prompts, run

  A. `stats: {refine_p: false}` (the interval's p alone: the baseline),
  B. the default (p below 1 - ci_level refined by the sign-flip test),
  C. B with `confirm: {k: 10, n: <prompts>}` (the top 10 heads again on as many fresh prompts),

on the real SmolLM2-135M folder when present (/root/.cache/entoscope/real-models/smollm2-135m), else a random
model of its shape (30 layers, 9 heads, 3 key/value heads, d_model 576; models/tiny.py's Llama config). It
prints each run's time, the ratios B/A and C/A (target <= 1.2x), the time of the refinement alone (the
statistics of the same per-prompt values with and without it), and the screen's and the confirmation's top
cells. Threads: --threads (default 1).

    python benchmarks/bench_confirm.py [--prompts 32] [--threads 1] [--random]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import set_threads  # noqa: E402

SMOLLM2 = Path("/root/.cache/entoscope/real-models/smollm2-135m")


def smollm2_shaped(seed: int = 0):
    """A random LlamaForCausalLM of SmolLM2-135M's shape (30 x 9 heads, 3 kv heads, d_model 576), small vocab."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from entoscope.models.tiny import tokenizer_dir, tiny_tokenizer

    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    return model, tokenizer_dir()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32, help="prompts of the screen and of the confirmation")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--random", action="store_true", help="the random model even when the real folder exists")
    ap.add_argument("--full", action="store_true", help="run B and C whole too (else: A whole, and what B and C "
                    "add to it measured alone: the statistics with and without refinement on A's per-prompt "
                    "values, and the confirmation run)")
    args = ap.parse_args()
    set_threads(args.threads)
    warnings.simplefilter("ignore")
    import numpy as np

    import entoscope as es
    from entoscope.stats import RatioStat, Stats, benjamini_hochberg, summarise

    if SMOLLM2.exists() and not args.random:
        model, what = es.load_model(str(SMOLLM2)), "SmolLM2-135M"
    else:
        hf, tok = smollm2_shaped()
        model, what = es.load_model(hf, tokenizer=tok), "a random model of SmolLM2-135M's shape"
    data = {"task": "ioi", "n": args.prompts, "seed": 0}
    sites = es.Sites(activation="z", over=["layer", "head"])
    t0 = time.perf_counter()
    a = es.Patching(sites=sites, stats={"refine_p": False}).run(model, data, quiet=True)
    base = time.perf_counter() - t0
    print(f"{what}, {args.prompts} prompts, {len(a.table)} heads")
    print(f"A refine_p false (whole run)      {base:8.1f} s", flush=True)
    # B differs from A only in the statistics: time them on A's per-prompt values (the ratio of means)
    pp = a.per_prompt
    diff = pp.pivot_table(index="example", columns="site", values="difference", sort=False)[list(a.table.site)]
    gap = pp.groupby("example")["source_metric"].first() - pp.groupby("example")["base_metric"].first()
    stat = RatioStat(diff.to_numpy(), gap.loc[diff.index].to_numpy())
    times = {}
    for flag in (False, True):
        t0 = time.perf_counter()
        s = summarise(stat, Stats(refine_p=flag), seed=0)
        times[flag] = time.perf_counter() - t0
        print(f"  statistics, refine_p={flag!s:5s}     {times[flag]:8.3f} s ({int(s.p_refined.sum()) if flag else 0} "
              "cells refined)")
    b = base + times[True] - times[False]
    rng = np.random.default_rng(0)  # the refinement at 32 prompts on a 270-cell table, 10% of cells shifted
    synthetic = rng.normal(size=(32, 270)) + np.r_[np.full(27, 1.0), np.zeros(243)]
    for flag in (False, True):
        t0 = time.perf_counter()
        s = summarise(RatioStat(synthetic, np.ones(32)), Stats(refine_p=flag), seed=0)
        print(f"  statistics of 32 x 270 synthetic values, refine_p={flag!s:5s} {time.perf_counter() - t0:8.3f} s "
              f"({int(s.p_refined.sum()) if flag else 0} cells refined)")
    t0 = time.perf_counter()
    top = a.table.sort_values("value_p").head(10)
    confirm = es.Patching(sites=sites).confirm_subset(top).run(
        model, {"task": "ioi", "n": args.prompts, "seed": 1_000_003}, quiet=True)
    stage = time.perf_counter() - t0
    print(f"  confirmation run (10 heads)      {stage:8.1f} s")
    print(f"B refined: A + statistics' difference = {b:.1f} s: {b / base:.3f}x")
    print(f"C refined + confirm k 10: B + confirmation run = {b + stage:.1f} s: {(b + stage) / base:.3f}x")
    if args.full:
        for name, op in (("B refined", es.Patching(sites=sites)),
                         ("C refined + confirm k 10", es.Patching(sites=sites, confirm={"k": 10, "n": args.prompts}))):
            t0 = time.perf_counter()
            r = op.run(model, data, quiet=True)
            print(f"{name} (whole run) {time.perf_counter() - t0:8.1f} s: {(time.perf_counter() - t0) / base:.3f}x")
    refined = summarise(stat, Stats(), seed=0)
    q = benjamini_hochberg(refined.p_value)
    print(f"significant at 5%: {int((a.table.value_q <= 0.05).sum())} of {len(a.table)} (interval p) -> "
          f"{int((q <= 0.05).sum())} (refined)")
    print(confirm.table.sort_values("value_p")[["site", "value", "value_ci_low", "value_ci_high", "value_p"]]
          .head(10).to_string(index=False))


if __name__ == "__main__":
    main()
