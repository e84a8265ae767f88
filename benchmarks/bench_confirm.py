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
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--random", action="store_true", help="the random model even when the real folder exists")
    args = ap.parse_args()
    set_threads(args.threads)
    warnings.simplefilter("ignore")
    import entoscope as es
    from entoscope.stats import Stats, mean_stat, summarise

    if SMOLLM2.exists() and not args.random:
        model, what = es.load_model(str(SMOLLM2)), "SmolLM2-135M"
    else:
        hf, tok = smollm2_shaped()
        model, what = es.load_model(hf, tokenizer=tok), "a random model of SmolLM2-135M's shape"
    data = {"task": "ioi", "n": args.prompts, "seed": 0}
    sites = es.Sites(activation="z", over=["layer", "head"])
    runs = {}
    for name, op in (("A refine_p false", es.Patching(sites=sites, stats={"refine_p": False})),
                     ("B refined", es.Patching(sites=sites)),
                     ("C refined + confirm k 10", es.Patching(sites=sites, confirm={"k": 10, "n": args.prompts}))):
        t0 = time.perf_counter()
        runs[name] = (op.run(model, data, quiet=True), time.perf_counter() - t0)
        print(f"{name:28s} {runs[name][1]:8.1f} s", flush=True)
    base = runs["A refine_p false"][1]
    for name in ("B refined", "C refined + confirm k 10"):
        print(f"{name} / A: {runs[name][1] / base:.3f}x")
    # the refinement alone: the same per-prompt values' statistics with and without it
    values = runs["B refined"][0].per_prompt.pivot_table(index="example", columns="site", values="difference")
    for flag in (False, True):
        t0 = time.perf_counter()
        summarise(mean_stat(values.to_numpy()), Stats(refine_p=flag), seed=0)
        print(f"statistics of {values.shape[1]} heads x {values.shape[0]} prompts, refine_p={flag}: "
              f"{time.perf_counter() - t0:.3f} s")
    a, b = runs["A refine_p false"][0].table, runs["B refined"][0].table
    print(f"{what}, {args.prompts} prompts: significant {int(a.significant.sum())} of {len(a)} (interval p) -> "
          f"{int(b.significant.sum())} (refined)")
    cols = ["site", "value", "value_ci_low", "value_ci_high", "value_p", "value_q"]
    print(b.sort_values("value_p").head(5)[cols].to_string(index=False))
    print(runs["C refined + confirm k 10"][0].confirmation.to_string(index=False))


if __name__ == "__main__":
    main()
