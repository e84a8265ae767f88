"""Benchmark of DAS over a grid: es.Interchange against one TransformerLens 4.3 fit_das call per cell.

    python benchmarks/bench_interchange.py              # demo model, 3 layers x 3 roles, 1 thread
    python benchmarks/bench_interchange.py --quick      # 8 prompts, 2 epochs: a smoke run
    python benchmarks/bench_interchange.py --smollm2    # SmolLM2-135M (real), layers 8 16 24, 16 prompts, 10 epochs
    /work/bin/heavy --big python benchmarks/bench_interchange.py --shape llama-3.2-1b --layers 8 --epochs 5
                                                        # Llama 3.2 1B's shape, random weights (benchmarks/shapes.py)

Model: the bundled demo model (3 layers, d_model 128) as a TransformerBridge; with --smollm2 the real
SmolLM2-135M folder (~/.cache/entoscope/real-models/smollm2-135m); with --shape a real model's shape with
random weights (its IIA means nothing; the time is the real model's). Data: ioi, n prompts (2n pairs:
each prompt and its name-swapped copy, both directions); half train DAS, half measure IIA. Grid: resid_post
at the layers (demo: 0, 1, 2) x roles S1, S2, END; DAS rank r, the same epochs, batch size, learning rate and
seed both ways.

Compared, in this one process, on the same intra-op threads (the same work both ways: per cell a DAS subspace
trained on the training pairs, then its IIA on the held-out pairs):
  (a) per cell: transformer_lens.tools.analysis.fit_das (its own source read, then epochs of full forwards and
      backwards), then collect_activations + intervened_logits on the held-out pairs;
  (b) es.Interchange(bases=["das"], placebo=False).run: one read of every prompt shared by the 9 cells,
      training runs that start at the cell's block from one cached forward, the class logits only (it also
      measures the full-vector interchange of every cell, which (a) does not).
Reported: CPU time (process_time) and wall time of each, the ratio (a) / (b), and both IIAs per cell.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import set_threads  # noqa: E402

ROLES = ["S1", "S2", "END"]


def per_cell(model, adapter, pairs, td, held, layers, rank, epochs, batch, lr, seed):
    """(a): one fit_das call per cell, its IIA on the held-out pairs by TransformerLens's own intervened_logits."""
    import numpy as np
    import torch
    from transformer_lens.tools.analysis import SubspaceInterchange, collect_activations, fit_das, intervened_logits

    from entoscope.data.tokenized import pad

    tokens, lengths = pad(td.prompts, 0)
    classes = torch.tensor([[adapter.token_id(c) for c in row] for row in pairs.classes])
    by_row = {tuple(tokens[i].tolist()): i for i in range(len(td.prompts))}
    roles = td.roles

    def task_logits(batch_tokens):
        rows = [by_row[tuple(r.tolist())] for r in batch_tokens]
        logits = model(batch_tokens)
        at = logits[torch.arange(len(rows)), lengths[rows] - 1]
        return at.gather(1, classes[pairs.base[rows]].to(at.device))

    train, test = np.flatnonzero(~held), np.flatnonzero(held)
    targets = torch.from_numpy(pairs.target)
    out = {}
    for role in ROLES:
        pos = roles.positions[:, roles.index(role)] if role != "END" else lengths - 1
        for layer in layers:
            hook = adapter.hook_name(f"resid_post.{layer}")
            b, s = pairs.base, pairs.source
            fit = fit_das(model, hook, tokens[b[train]], tokens[s[train]], targets[train], task_logits, rank=rank,
                          base_positions=pos[b[train]], source_positions=pos[s[train]], epochs=epochs,
                          batch_size=batch, lr=lr, seed=seed)
            src = collect_activations(model, hook, tokens[s[test]], task_logits, positions=pos[s[test]])
            logits = intervened_logits(model, hook, SubspaceInterchange(fit.subspace), tokens[b[test]], src,
                                       task_logits, positions=pos[b[test]])
            out[f"resid_post.{layer}@{role}"] = float((logits.argmax(-1) == targets[test]).double().mean())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=None, help="ioi prompts (default 32; 16 on SmolLM2 or a shape)")
    ap.add_argument("--epochs", type=int, default=None, help="DAS epochs (default 20, fit_das's; 10 on SmolLM2 "
                    "or a shape)")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smollm2", action="store_true", help="the real SmolLM2-135M folder")
    ap.add_argument("--shape", help="a shape of benchmarks/shapes.py with random weights, e.g. llama-3.2-1b")
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="the grid's layers (default 0 1 2 on the demo model, 8 16 24 on SmolLM2, the middle one "
                         "on a shape)")
    args = ap.parse_args()
    big = args.smollm2 or args.shape
    args.prompts = args.prompts or (16 if big else 32)
    args.epochs = args.epochs or (10 if big else 20)
    if args.quick:
        args.prompts, args.epochs = 8, 2
    set_threads(args.threads)
    import entoscope as es
    from entoscope.data.tokenized import tokenize_data
    from entoscope.interchange.causal import build_pairs, split
    from entoscope.models.adapter import adapt

    if args.smollm2:
        from pathlib import Path

        model, name = es.load_model(str(Path.home() / ".cache/entoscope/real-models/smollm2-135m")), "SmolLM2-135M"
    elif args.shape:
        import shapes  # benchmarks/shapes.py: real models' shapes with random weights

        model, name = shapes.build(args.shape, "float32"), f"{shapes.shape_name(args.shape)} shape (random weights)"
    else:
        model, name = es.load_model("demo"), "demo model"
    layers = args.layers or ([8, 16, 24] if args.smollm2 else [model.cfg.n_layers // 2] if args.shape else [0, 1, 2])
    adapter = adapt(model)
    data = es.tasks.ioi(n=args.prompts, seed=0)
    op = es.Interchange(activation="resid_post", layers=layers, positions=ROLES, bases=["das"], placebo=False,
                        rank=args.rank, epochs=args.epochs, das_batch_size=16, lr=0.05, seed=0)
    op.plan(model, data)  # the once-per-model checks, outside both timings
    pairs = build_pairs(data, None)
    td = tokenize_data(adapter, pairs.prompts)
    held = split(pairs, op.test_share, op.seed)

    c0, w0 = time.process_time(), time.perf_counter()
    theirs = per_cell(model, adapter, pairs, td, held, layers, args.rank, args.epochs, 16, 0.05, 0)
    ca, wa = time.process_time() - c0, time.perf_counter() - w0
    c0, w0 = time.process_time(), time.perf_counter()
    result = op.run(model, data, quiet=True)
    cb, wb = time.process_time() - c0, time.perf_counter() - w0
    t = result.table.set_index(["site", "basis"])
    print(f"{name}: {len(pairs)} pairs ({int(held.sum())} held out), {len(layers) * len(ROLES)} cells (layers "
          f"{layers} x {ROLES}), rank {args.rank}, {args.epochs} epochs, {args.threads} thread(s)")
    print(f"(a) fit_das per cell: CPU {ca:.1f} s, wall {wa:.1f} s")
    print(f"(b) es.Interchange:   CPU {cb:.1f} s, wall {wb:.1f} s")
    print(f"ratio (a)/(b): CPU {ca / cb:.2f}x, wall {wa / wb:.2f}x")
    for site, iia in theirs.items():
        row = t.loc[(site, "das")]
        print(f"  {site:18s} IIA fit_das {iia:.3f}  entoscope {row['iia']:.3f} "
              f"[{row['iia_ci_low']:.3f}, {row['iia_ci_high']:.3f}]")


if __name__ == "__main__":
    main()
