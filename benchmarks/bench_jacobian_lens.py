"""Fitting the Jacobian lens: entoscope's JacobianLensFit (one forward per batch of prompts, batched
vector-Jacobian products over positions skip_first.. only, elementwise activations backpropagated as one
multiply) against TransformerLens 4.3's JacobianLens.fit (per prompt: a forward of dim_batch=8 copies and
d_model/8 backward passes over every position) in the same script, on the same random 4-layer GPT-2
(d_model 256) bridge and the same texts (the built-in corpus task, cut to 64 tokens, skip_first 16).
Both matrices are compared: the largest absolute difference must be at most 1e-4 x max(1, largest entry)
(float32 rounding; entries are O(1)). Times: CPU seconds (time.process_time) and wall seconds.
Threads: --threads (default 1), set for torch before anything runs.

    python benchmarks/bench_jacobian_lens.py [--threads 1] [--quick]
    python benchmarks/bench_jacobian_lens.py --smollm2   # one 60-token text, layers 18/22/26 of SmolLM2-135M
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import set_threads  # noqa: E402


def model_4x256():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from entoscope.models.loading import from_hf
    from entoscope.models.tiny import tiny_tokenizer, tokenizer_dir

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=512, bos_token_id=0,
                                    eos_token_id=0)).eval()
    hf.config._attn_implementation = "eager"
    return from_hf(hf, tiny_tokenizer(), backend="bridge", name="gpt2-4x256-random", folder=tokenizer_dir())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 prompts instead of 8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smollm2", action="store_true", help="the real SmolLM2-135M folder: one 60-token text, "
                    "layers 18/22/26 (what the report's lens section fits), seconds per text")
    args = ap.parse_args()
    threads = set_threads(args.threads)
    if args.smollm2:
        return smollm2(threads)
    from transformer_lens.tools.analysis import JacobianLens as TLJacobianLens

    import entoscope as es

    n = 2 if args.quick else 8
    model = model_4x256()
    data = es.tasks.get("corpus", n=n, seed=1)
    texts = [ex.prompt for ex in data]
    es.JacobianLens.fit(model, data[:1], max_length=64, quiet=True)  # warm-up (model checks, allocator)
    TLJacobianLens.fit(model, texts[:1], corpus="c", max_seq_len=64, show_progress=False)
    c, w = time.process_time(), time.perf_counter()
    theirs = TLJacobianLens.fit(model, texts, corpus="c", max_seq_len=64, show_progress=False)
    tl_cpu, tl_s = time.process_time() - c, time.perf_counter() - w
    c, w = time.process_time(), time.perf_counter()
    ours = es.JacobianLens.fit(model, data, max_length=64, quiet=True)
    es_cpu, es_s = time.process_time() - c, time.perf_counter() - w
    diff = max(float((ours.jacobians[L] - theirs.jacobians[L]).abs().max()) for L in ours.source_layers)
    scale = max(float(theirs.jacobians[L].abs().max()) for L in ours.source_layers)
    plan = ours.fit_result.plan
    print(f"Jacobian lens fit, {n} texts (<= 64 tokens, skip_first 16), 4-layer d_model-256 GPT-2 bridge, "
          f"{threads} threads; entoscope batches {plan.batch_sizes}, {plan.notes[0]}")
    print(f"  TransformerLens JacobianLens.fit   {tl_cpu:.2f} CPU s  {tl_s:.2f} wall s")
    print(f"  entoscope JacobianLens.fit         {es_cpu:.2f} CPU s  {es_s:.2f} wall s")
    print(f"  ratio (TL time / entoscope time): {tl_cpu / es_cpu:.2f}x CPU, {tl_s / es_s:.2f}x wall")
    print(f"  largest |J_entoscope - J_TL| {diff:.2e} (largest entry {scale:.2f}); prompts {ours.n_prompts} = "
          f"{theirs.n_prompts}; tolerance {1e-4 * max(1.0, scale):.1e}")
    assert diff <= 1e-4 * max(1.0, scale), "the matrices differ"


def smollm2(threads: int) -> None:
    from transformer_lens.tools.analysis import JacobianLens as TLJacobianLens

    import entoscope as es
    from entoscope.models.adapter import adapt
    from entoscope.models.partial import prefix_support

    model = es.load_model(str(Path.home() / ".cache/entoscope/real-models/smollm2-135m"))
    data = es.tasks.get("corpus", n=1, seed=1)
    layers = [18, 22, 26]
    c, w = time.process_time(), time.perf_counter()
    ours = es.JacobianLens.fit(model, data, layers=layers, max_length=60, quiet=True)
    es_cpu, es_s = time.process_time() - c, time.perf_counter() - w
    c, w = time.process_time(), time.perf_counter()
    theirs = TLJacobianLens.fit(model, [ex.prompt for ex in data], corpus="c", source_layers=layers, max_seq_len=60,
                                show_progress=False)
    tl_cpu, tl_s = time.process_time() - c, time.perf_counter() - w
    diff = max(float((ours.jacobians[L] - theirs.jacobians[L]).abs().max()) for L in layers)
    scale = max(float(theirs.jacobians[L].abs().max()) for L in layers)
    n_tok = len(adapt(model).tokenize(data[0].prompt))
    print(f"Jacobian lens fit, SmolLM2-135M, one text ({min(n_tok, 60)} tokens), layers {layers}, {threads} threads; "
          f"start part-way: {prefix_support(adapt(model))}")
    print(f"  TransformerLens JacobianLens.fit   {tl_cpu:.1f} CPU s  {tl_s:.1f} wall s")
    print(f"  entoscope JacobianLens.fit         {es_cpu:.1f} CPU s  {es_s:.1f} wall s")
    print(f"  ratio (TL time / entoscope time): {tl_cpu / es_cpu:.2f}x CPU, {tl_s / es_s:.2f}x wall")
    print(f"  largest |J_entoscope - J_TL| {diff:.2e} (largest entry {scale:.2f}); "
          f"tolerance {1e-4 * max(1.0, scale):.1e}")
    assert diff <= 1e-4 * max(1.0, scale), "the matrices differ"


if __name__ == "__main__":
    main()
