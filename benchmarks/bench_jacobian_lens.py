"""Fitting the Jacobian lens: entoscope's JacobianLensFit against TransformerLens 4.3's JacobianLens.fit in the
same script, on the same model, texts, source layers and positions, one thread.

entoscope: per batch of prompts one forward of 8 copies of each prompt over positions skip_first.. only (the
earlier ones a frozen key/value prefix), copy k carrying the one-hot cotangent of output dimension k of its
chunk, then d_model/8 plain backward calls; elementwise activations backpropagate as one multiply, RMS norms
by their closed form.
TransformerLens: per prompt a forward of dim_batch=8 copies over every position, then d_model/8 backward passes.
Both matrices are compared: the largest absolute difference must be at most 1e-4 x max(1, largest entry)
(float32 rounding; entries are O(1)). Times: CPU seconds (time.process_time) and wall seconds, after a warm-up
fit of each (4 tokens, one layer: the once-per-model checks and the allocator, outside both timings).
With --rounds 2 the fits run in the order TransformerLens, entoscope, entoscope, TransformerLens and the ratio
is of the summed times (a load that drifts during the run weighs on both alike).

    python benchmarks/bench_jacobian_lens.py [--threads 1] [--quick]
        a random 4-layer d_model-256 GPT-2 bridge, 8 corpus texts cut to 64 tokens, skip_first 16
    python benchmarks/bench_jacobian_lens.py --smollm2 [--texts 2] [--rounds 2]
        the real SmolLM2-135M folder (~/.cache/entoscope/real-models/smollm2-135m), corpus texts cut to 60
        tokens, skip_first 16, layers 18/22/26 of 30
    /work/bin/heavy --big python benchmarks/bench_jacobian_lens.py --shape llama-3.2-1b [--layers 14]
        Llama 3.2 1B's shape with random weights (benchmarks/shapes.py; float32, ~5 GB), one corpus text cut
        to 60 tokens (the tiny test tokenizer), skip_first 16, source layer 14 of 16 (the last block's
        transport: a few minutes a side)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import set_threads  # noqa: E402

SMOLLM2 = Path.home() / ".cache/entoscope/real-models/smollm2-135m"


def model_4x256() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from entoscope.models.loading import from_hf
    from entoscope.models.tiny import tiny_tokenizer, tokenizer_dir

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=512, bos_token_id=0,
                                    eos_token_id=0)).eval()
    hf.config._attn_implementation = "eager"
    return from_hf(hf, tiny_tokenizer(), backend="bridge", name="gpt2-4x256-random", folder=tokenizer_dir())


def side_by_side(model: Any, data: Any, layers: list[int] | None, max_length: int, skip_first: int,
                 rounds: int) -> dict[str, Any]:
    """Warm both fits up, then time them (rounds=2: TL, entoscope, entoscope, TL); compare the matrices."""
    from transformer_lens.tools.analysis import JacobianLens as TLJacobianLens

    import entoscope as es

    texts = [ex.prompt for ex in data]
    n_layers = model.cfg.n_layers
    # warm-up: one layer, 4 tokens (the once-per-model checks, the allocator), outside both timings
    es.JacobianLens.fit(model, data[:1], layers=[n_layers - 2], max_length=4, skip_first=1, quiet=True)
    TLJacobianLens.fit(model, texts[:1], corpus="c", source_layers=[n_layers - 2], max_seq_len=4,
                       skip_first_positions=1, show_progress=False)

    def tl() -> Any:
        return TLJacobianLens.fit(model, texts, corpus="c", source_layers=layers, max_seq_len=max_length,
                                  skip_first_positions=skip_first, show_progress=False)

    def ours() -> Any:
        return es.JacobianLens.fit(model, data, layers=layers, max_length=max_length, skip_first=skip_first,
                                   quiet=True)

    order = [("tl", tl), ("es", ours)] if rounds == 1 else [("tl", tl), ("es", ours), ("es", ours), ("tl", tl)]
    times: dict[str, list[tuple[float, float]]] = {"tl": [], "es": []}
    lenses = {}
    for name, fit in order:
        c, w = time.process_time(), time.perf_counter()
        lenses[name] = fit()
        times[name].append((time.process_time() - c, time.perf_counter() - w))
    theirs, mine = lenses["tl"], lenses["es"]
    src = mine.source_layers
    diff = max(float((mine.jacobians[L] - theirs.jacobians[L]).abs().max()) for L in src)
    scale = max(float(theirs.jacobians[L].abs().max()) for L in src)
    return {"times": times, "diff": diff, "scale": scale, "lens": mine, "n_prompts": (mine.n_prompts,
                                                                                      theirs.n_prompts)}


def matmul_floor(model: Any, data: Any, layers: list[int], max_length: int, skip_first: int) -> dict[str, float]:
    """What the backward's matrix products alone take: per vector-Jacobian product and graph position, one
    multiply-add per weight of the blocks after the first source layer (the linear layers' input gradients;
    the attention's own products, a few percent, left out), at this machine's sgemm rate measured here
    (a [8 x 43 rows, d_model] x [d_model, d_mlp] product, best of 5). entoscope's graph holds positions
    skip_first..len-2 of each prompt, TransformerLens's every position."""
    import torch

    from entoscope.models.adapter import adapt

    a = adapt(model)
    s = a.structure
    first = min(layers) if layers else 0
    per_position = sum(p.numel() for L in range(first + 1, s.n_layers) for p in model.blocks[L].parameters()
                       if p.dim() == 2)
    lengths = [min(len(a.tokenize(ex.prompt)), max_length) for ex in data]
    ours = sum(max(0, n - 1 - skip_first) for n in lengths) * s.d_model * per_position
    theirs = sum(lengths) * s.d_model * per_position
    x, w = torch.randn(8 * 43, s.d_model), torch.randn(s.d_model, s.d_mlp)
    best = float("inf")
    for _ in range(5):
        c = time.process_time()
        x @ w
        best = min(best, time.process_time() - c)
    rate = x.shape[0] * s.d_model * s.d_mlp / best
    return {"rate": rate / 1e9, "tl": theirs / rate, "es": ours / rate}


def report(what: str, out: dict[str, Any]) -> None:
    t = out["times"]
    tl_cpu, tl_wall = sum(c for c, _ in t["tl"]), sum(w for _, w in t["tl"])
    es_cpu, es_wall = sum(c for c, _ in t["es"]), sum(w for _, w in t["es"])
    plan = out["lens"].fit_result.plan
    print(what)
    print(f"  entoscope: batches {plan.batch_sizes}; {plan.notes[0]}")

    def each(k: str) -> str:
        return ", ".join(f"{c:.1f}" for c, _ in t[k])
    print(f"  TransformerLens JacobianLens.fit   {tl_cpu:.1f} CPU s ({each('tl')})  {tl_wall:.1f} wall s")
    print(f"  entoscope JacobianLens.fit         {es_cpu:.1f} CPU s ({each('es')})  {es_wall:.1f} wall s")
    print(f"  ratio (TL time / entoscope time): {tl_cpu / es_cpu:.2f}x CPU, {tl_wall / es_wall:.2f}x wall")
    print(f"  largest |J_entoscope - J_TL| {out['diff']:.2e} (largest entry {out['scale']:.2f}); prompts "
          f"{out['n_prompts'][0]} = {out['n_prompts'][1]}; tolerance {1e-4 * max(1.0, out['scale']):.1e}")
    if "floor" in out:
        f = out["floor"]
        print(f"  matrix-product floor (the backward's linear layers at {f['rate']:.0f} GMAC/s): TransformerLens "
              f"{f['tl']:.1f} CPU s, entoscope {f['es']:.1f} CPU s ({f['tl'] / f['es']:.2f}x: the positions in "
              f"the graph); measured over floor: TransformerLens {tl_cpu / len(t['tl']) / f['tl']:.2f}x, "
              f"entoscope {es_cpu / len(t['es']) / f['es']:.2f}x")
    assert out["n_prompts"][0] == out["n_prompts"][1], "the two fits kept different prompts"
    assert out["diff"] <= 1e-4 * max(1.0, out["scale"]), "the matrices differ"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="demo model: 2 texts instead of 8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smollm2", action="store_true", help="the real SmolLM2-135M folder, layers 18/22/26")
    ap.add_argument("--shape", help="a shape of benchmarks/shapes.py with random weights, e.g. llama-3.2-1b")
    ap.add_argument("--dtype", default="float32", help="--shape's dtype (float32: the fit's own precision)")
    ap.add_argument("--texts", type=int, default=None, help="corpus texts (default 8 demo, 2 SmolLM2, 1 shape)")
    ap.add_argument("--max-length", type=int, default=None, help="tokens per text (default 64 demo, 60 else)")
    ap.add_argument("--skip-first", type=int, default=16, help="leading positions left out (both fits)")
    ap.add_argument("--layers", type=int, nargs="*", default=None,
                    help="source layers (default: every layer but the last on the demo model, 18 22 26 on "
                         "SmolLM2, the last but one on a shape)")
    ap.add_argument("--rounds", type=int, choices=(1, 2), default=None,
                    help="1: TL then entoscope; 2: TL, entoscope, entoscope, TL (default 2 on SmolLM2, else 1)")
    args = ap.parse_args()
    threads = set_threads(args.threads)
    import entoscope as es

    if args.smollm2:
        model = es.load_model(str(SMOLLM2))
        name, n, length, layers, rounds = "SmolLM2-135M (real weights)", 2, 60, [18, 22, 26], 2
    elif args.shape:
        import shapes  # benchmarks/shapes.py: real models' shapes with random weights

        c = time.perf_counter()
        model = shapes.build(args.shape, args.dtype)
        print(f"built {shapes.shape_name(args.shape)} ({args.dtype}, random weights) in "
              f"{time.perf_counter() - c:.0f} s")
        name, n, length, layers, rounds = f"{shapes.shape_name(args.shape)} shape ({args.dtype}, random weights)", \
            1, 60, [model.cfg.n_layers - 2], 1
    else:
        model = model_4x256()
        name, n, length, layers, rounds = "random 4-layer d_model-256 GPT-2 bridge", 2 if args.quick else 8, 64, \
            None, 1
    n = args.texts or n
    length = args.max_length or length
    layers = args.layers if args.layers is not None else layers
    rounds = args.rounds or rounds
    data = es.tasks.get("corpus", n=n, seed=1)
    out = side_by_side(model, data, layers, length, args.skip_first, rounds)
    src = out["lens"].source_layers
    out["floor"] = matmul_floor(model, data, src, length, args.skip_first)
    report(f"Jacobian lens fit, {name}: {n} corpus text(s) cut to {length} tokens, skip_first {args.skip_first}, "
           f"layers {src if len(src) <= 6 else f'{src[0]}..{src[-1]}'}, {threads} thread(s), {rounds} round(s)", out)


if __name__ == "__main__":
    main()
